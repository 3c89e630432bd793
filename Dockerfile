# kvd in a container. The CUDA runtime base lets the GPU backend (cupy)
# work with `--gpus all`; without GPUs the host backend serves as usual.
# The base is CUDA 13.0: the GPU path needs a host NVIDIA driver for CUDA 13
# (release 580 or newer; `nvidia-smi` shows "CUDA Version: 13.x"). With an
# older driver the daemon logs "CUDA backend off: ..." and serves on the
# host backend (gpu = on: it exits with that line).
#
#   docker build -t kvd .
#   install -d -o 10001 -g 10001 -m 0700 /run/kvd    # on the host, once per boot
#   docker run -d --name kvd --ipc=host --gpus all --ulimit memlock=-1 \
#     -v /run/kvd:/run/kvd kvd
#
# /run/kvd on the host must exist and belong to uid 10001 (the kvd user
# here) before the container starts: docker would make it root's, and the
# daemon (not root) then stops at once with "runtime_dir: /run/kvd belongs to
# uid 0, ...". /run is emptied at boot: a line `d /run/kvd 0700 10001 10001 -`
# in /etc/tmpfiles.d/kvd.conf makes it at every boot (0750 with
# KVD_ACCESS_GROUP=10001, below).
# --ipc=host: the host tier and engines' host-backend pools live in
#   /dev/shm and must be the same /dev/shm the engines see; CUDA IPC
#   between engine containers and kvd also needs a shared IPC namespace.
#   Without --ipc=host, give the container a /dev/shm larger than
#   host_capacity (--shm-size) and run the engines in the same container.
# -v /run/kvd:/run/kvd: the sockets, so engines (on the host or in other
#   containers mounting the same directory) can connect. The directory is
#   0700 for uid 10001 (the kvd user here) unless KVD_ACCESS_GROUP is set:
#   -e KVD_ACCESS_GROUP=10001 makes it 0750 and the sockets 0660 of gid
#   10001, and engines run with that primary gid (--user UID:10001) connect
#   (docs/install.md, "Engines of other users and in other containers").
# Metrics: configs/kvd.toml serves /metrics on 127.0.0.1:9477 inside the
#   container; publish it with -e KVD_METRICS_ADDRESS=0.0.0.0 -p 127.0.0.1:9477:9477.
# Disk tier: mount the NVMe directory and name it, e.g.
#   -v /nvme/kvd:/var/lib/kvd -e KVD_DISK_DIR=/var/lib/kvd -e KVD_DISK_CAPACITY=2TiB
#   (owned by uid 10001). GPU Direct Storage: build with
#   `--build-arg KVD_EXTRAS=gds,metrics` (adds KvikIO), run with KVD_DISK_GDS=true; real
#   GDS also needs the host's nvidia-fs devices, else KvikIO's compatibility mode.
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04
ARG KVD_EXTRAS=gpu,metrics

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 KVD_RUNTIME_DIR=/run/kvd
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvd ./kvd
COPY kernels ./kernels
COPY clients ./clients
COPY configs/kvd.toml /etc/kvd/kvd.toml
# kvd-cache (the distribution; PyPI's "kvd" is an unrelated project) from this checkout's copy
RUN python3 -m venv /opt/kvd \
 && /opt/kvd/bin/pip install ".[${KVD_EXTRAS}]" \
 && rm -rf /src

RUN groupadd --gid 10001 --system kvd \
 && useradd --uid 10001 --gid 10001 --system --no-create-home kvd \
 && mkdir -p /run/kvd && chown kvd:kvd /run/kvd && chmod 0700 /run/kvd
USER kvd
WORKDIR /tmp

# The host tier is allocated in full before kvd serves: about 1-2 minutes per 100 GiB
# on 4 KiB pages. Failures during the start period do not count; the first success
# ends it, so a long one costs nothing.
HEALTHCHECK --interval=10s --timeout=5s --start-period=10m \
  CMD ["/opt/kvd/bin/kvd", "health", "--timeout", "3"]
ENTRYPOINT ["/opt/kvd/bin/kvd"]
CMD ["serve", "--config", "/etc/kvd/kvd.toml"]
