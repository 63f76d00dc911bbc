# The pipesched HTTP service (no torch: the runtime runs on the training cluster, not here).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin pipesched

WORKDIR /app
COPY pyproject.toml README.md ./
COPY pipesched ./pipesched
COPY optimizer ./optimizer
COPY api ./api
COPY runtime ./runtime
# The workers extra (procrastinate, psycopg): the same image runs either role, `pipesched serve` (the CMD)
# or `pipesched worker` (docker run … IMAGE pipesched worker), over PostgreSQL. DL3013 asks to pin what pip
# installs: this is the project itself, whose dependencies pyproject.toml bounds.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir '.[workers]'

USER 10001
# The service listens on every interface here, so `pipesched serve` refuses to start without a token:
#   docker run -e PIPESCHED_API_TOKEN=<secret> -p 8000:8000 pipesched   (clients send `Authorization: Bearer <secret>`)
# PIPESCHED_ALLOW_NO_TOKEN=1 serves it open on purpose (a private network that does its own authentication).
ENV PIPESCHED_HOST=0.0.0.0 \
    PIPESCHED_PORT=8000 \
    PIPESCHED_DATABASE_URL=sqlite:////home/pipesched/pipesched.db
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/healthz', timeout=4)"]
CMD ["pipesched", "serve", "--host", "0.0.0.0", "--port", "8000"]
