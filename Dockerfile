# One image for the operator and the workers. Multi-stage: build the wheel, install it into a
# slim runtime that runs as a non-root user.
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
USER 10001
WORKDIR /home/dynatrain
ENTRYPOINT ["dynatrain"]
CMD ["--help"]
