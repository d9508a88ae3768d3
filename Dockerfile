# Two images from one wheel. Multi-stage: build the wheel, install it into a slim runtime that
# runs as a non-root user (numeric UID, so Kubernetes' runAsNonRoot can verify it).
#
#   docker build --target operator -t dynatrain-operator .   the operator, no torch (~200 MB)
#   docker build -t dynatrain .                               the workers (torch & co., ~6 GB)
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

# The operator: the wheel without its dependencies, and only the operator's own
# (operator/requirements.txt): it imports no torch, and serves the jobs' rendezvous stores
# over gRPC. The chart runs this image.
FROM python:3.11-slim AS operator
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin dynatrain
COPY operator/requirements.txt /tmp/operator-requirements.txt
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir -r /tmp/operator-requirements.txt \
    && pip install --no-cache-dir --no-deps /wheels/*.whl \
    && rm -rf /wheels /tmp/operator-requirements.txt
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
USER 10001
WORKDIR /home/dynatrain
# 8080: liveness, 9090: metrics.
EXPOSE 8080 9090
ENTRYPOINT ["dynatrain"]
CMD ["operator", "--help"]

# The workers (the default target): the wheel with every dependency, torch included.
FROM python:3.11-slim AS worker
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
