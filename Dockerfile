# One image for the operator and the workers. Multi-stage: build the wheel, install it into a
# slim runtime that runs as a non-root user (numeric UID, so Kubernetes' runAsNonRoot can
# verify it).
#
#   operator (charts/dynatrain):  dynatrain operator --liveness http://0.0.0.0:8080/healthz --metrics-port 9090
#   worker pods (the operator):   dynatrain worker --job JOB.yaml --device N --host 0.0.0.0 ...
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY dynatrain/ dynatrain/
COPY vps/ vps/
COPY agent/ agent/
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin dynatrain
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
# Logs reach `kubectl logs` at once; the wheel's modules are compiled at install time, so
# nothing needs to write .pyc files (the operator runs with a read-only root filesystem).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001
WORKDIR /home/dynatrain
# 8080: operator liveness, 9090: operator metrics, 50051: a worker's agent (gRPC, spec.agent.port).
EXPOSE 8080 9090 50051
ENTRYPOINT ["dynatrain"]
CMD ["--help"]
