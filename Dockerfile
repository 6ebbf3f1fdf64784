# The mergepipe image of the team setup (docker-compose.yml): the project with the CPU build of torch 2.13.0,
# psycopg for the PostgreSQL catalog, dask/distributed for the scheduler and its workers. The same image runs
# `dask scheduler`, `dask worker` and `mergepipe`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0

WORKDIR /opt/mergepipe
COPY pyproject.toml README.md ./
COPY mergepipe_db ./mergepipe_db
COPY sql ./sql
COPY migrations ./migrations
RUN pip install ".[postgres]"

# numba's compiled kernels are cached here (written by the first merge a worker runs)
ENV NUMBA_CACHE_DIR=/tmp/numba-cache
WORKDIR /work
CMD ["mergepipe", "--help"]
