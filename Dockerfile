# The exo image for compose.yaml: the project installed with uv from its lock file.
FROM python:3.11-slim
RUN pip install --no-cache-dir uv
WORKDIR /app
COPY . .
RUN uv sync --frozen --no-dev
ENV PATH="/app/.venv/bin:$PATH"
ENTRYPOINT []
CMD ["exo"]
