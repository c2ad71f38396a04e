# One image for the three services (allocator_svc, executor_svc, gateway); docker-compose.yml
# picks the command. CPU by default: torch comes from PyTorch's CPU wheel index
# (TORCH_PIP_ARGS; plain `torch` from the package registry is the CUDA build, several GB of
# CUDA libraries this image never uses). Everything else comes from the ordinary registry, with
# PIP_EXTRA_ARGS for any options of your own (a mirror, a proxy's certificate). For example:
#   docker compose build                                   # CPU torch from its wheel index
#   docker compose build --build-arg TORCH_PIP_ARGS="--index-url <your CPU wheel mirror>"
#   docker compose build --build-arg BASE_IMAGE=<a local python 3.11 image>
# Without that index: put a torch wheel in deploy/docker-wheels/ and build with
#   --build-arg TORCH_PIP_ARGS= --build-arg TORCH_SPEC=torch==2.13.0+cpu   (make compose-e2e)
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}

ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu"
ARG PIP_EXTRA_ARGS=""

# The services' own virtualenv: the same on python:3.11-slim and on a plain Debian base whose
# system Python refuses pip installs (PEP 668).
ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGEDKV_LOG_JSON=true \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

WORKDIR /app

# A compiler for the executor's C++ CPU kernels, built below once for a portable level: AVX2 and
# FMA (x86-64-v3), which every CPU the project runs on has; on the AMX machine a bf16 decode
# step with kernels built so was within 3% of a native AVX-512 build (bench/README.md). Pass native for the build machine's
# own CPU, or x86-64-v2 for CPUs older than AVX2.
ARG PAGEDKV_KERNEL_MARCH=x86-64-v3
ENV PAGEDKV_KERNEL_MARCH=${PAGEDKV_KERNEL_MARCH}
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv && pip install -q --upgrade pip

# Heavy, rarely changing layers first: torch (its own index options), then the project's
# dependencies (the ordinary registry).
COPY deploy/docker-wheels /tmp/wheels
RUN pip install --find-links /tmp/wheels ${TORCH_PIP_ARGS} "${TORCH_SPEC}"
COPY pyproject.toml ./
RUN pip install ${PIP_EXTRA_ARGS} .

COPY protos ./protos
RUN python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
        $(find protos -name '*.proto')

# The embedded real model (SmolLM2-135M-Instruct), converted once at build time; the
# conversion-only packages stay out of the services' way (nothing imports them at run time).
COPY models ./models
RUN pip install ${PIP_EXTRA_ARGS} gguf accelerate \
    && python models/fetch_smollm2.py --out models/smollm2-135m-instruct \
    && chmod -R a+rX models

# The kernels before the rest of the sources (minutes of compiling, cached across edits):
# they need only their own package, common/model_dirs.py and common/cpu_info.py
# (tests/deploy/test_compose_file.py imports them from exactly these files).
COPY common/__init__.py common/model_dirs.py common/cpu_info.py ./common/
COPY executor_svc/__init__.py ./executor_svc/
COPY executor_svc/cpu_kernels ./executor_svc/cpu_kernels
RUN python -m executor_svc.cpu_kernels

COPY common ./common
COPY allocator_svc ./allocator_svc
COPY executor_svc ./executor_svc
COPY gateway ./gateway
COPY tools ./tools
COPY pagedkv_client ./pagedkv_client
# COPY keeps the build machine's modes (a checkout made with umask 077 has 0600 files): open
# the sources to all (not models/, which its own step did without copying 538 MB again).
RUN chmod -R a+rX pyproject.toml protos pagedkv common allocator_svc executor_svc gateway \
        tools pagedkv_client build

# /run/pagedkv: where each service finds its own role's credentials, and /run/pagedkv/<role>
# where compose's credentials service writes them (a named volume mounted there starts with
# the directory's owner).
RUN useradd --system --uid 10001 pagedkv && chown -R pagedkv build \
    && mkdir -p /run/pagedkv/gateway /run/pagedkv/allocator /run/pagedkv/executor \
    && chown -R pagedkv /run/pagedkv
USER pagedkv
# The services run as this user (compose, and the Kubernetes manifests with runAsUser 10001):
# the build fails here if it cannot read every file it needs.
RUN bad="$(find /app /opt/venv \( ! -readable -o -type d ! -executable \) -print)"; \
    [ -z "$bad" ] || { echo "not readable by user pagedkv:"; echo "$bad"; exit 1; } >&2

EXPOSE 50051 50052 50053 8000 9092 9093
CMD ["python", "-m", "tools.launch", "--log-dir", "/tmp"]
