# One image for the three services (allocator_svc, executor_svc, gateway); docker-compose.yml
# picks the command. CPU by default: torch is pinned by a build argument, and any package
# index options go in PIP_EXTRA_ARGS (for example a CPU-only wheel index), e.g.
#   docker compose build --build-arg PIP_EXTRA_ARGS="--index-url <your CPU wheel index>"
FROM python:3.11-slim

ARG TORCH_SPEC=torch==2.13.0
ARG PIP_EXTRA_ARGS=""

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PAGEDKV_LOG_JSON=true

WORKDIR /app

# A compiler for the executor's C++ CPU kernels, built below once for the build machine's CPU
# (-march=native); for an image that runs on other CPUs, pass e.g.
# --build-arg PAGEDKV_KERNEL_MARCH=x86-64-v3.
ARG PAGEDKV_KERNEL_MARCH=native
ENV PAGEDKV_KERNEL_MARCH=${PAGEDKV_KERNEL_MARCH}
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
    && rm -rf /var/lib/apt/lists/*

# Heavy, rarely changing layers first: torch, then the project's dependencies.
RUN pip install ${PIP_EXTRA_ARGS} "${TORCH_SPEC}"
COPY pyproject.toml ./
RUN pip install ${PIP_EXTRA_ARGS} .

COPY protos ./protos
RUN python -m grpc_tools.protoc -Iprotos --python_out=. --grpc_python_out=. --pyi_out=. \
        $(find protos -name '*.proto')

# The embedded real model (SmolLM2-135M-Instruct), converted once at build time; the
# conversion-only packages stay out of the services' way (nothing imports them at run time).
COPY models ./models
RUN pip install ${PIP_EXTRA_ARGS} gguf accelerate \
    && python models/fetch_smollm2.py --out models/smollm2-135m-instruct

COPY common ./common
COPY allocator_svc ./allocator_svc
COPY executor_svc ./executor_svc
COPY gateway ./gateway
COPY tools ./tools
COPY pagedkv_client ./pagedkv_client
RUN python -m executor_svc.cpu_kernels

# /run/pagedkv: where each service finds its own role's credentials, and /run/pagedkv/<role>
# where compose's credentials service writes them (a named volume mounted there starts with
# the directory's owner).
RUN useradd --system --uid 10001 pagedkv && chown -R pagedkv build \
    && mkdir -p /run/pagedkv/gateway /run/pagedkv/allocator /run/pagedkv/executor \
    && chown -R pagedkv /run/pagedkv
USER pagedkv

EXPOSE 50051 50052 50053 8000 9092 9093
CMD ["python", "-m", "tools.launch", "--log-dir", "/tmp"]
