# ckptd as a sidecar next to a training container (docs/deployment/docker.md).
#
#   docker build -t ckptd .                              # default: no torch, small
#   docker build --target deepspeed -t ckptd:deepspeed .  # + torch (CPU) and deepspeed
#
# The default image cannot open DeepSpeed's mp_rank_00_model_states.pt to read the world
# size; it counts the ranks' files each checkpoint holds instead (the deepspeed image reads
# it from each checkpoint). A world_size set to the wrong number holds every checkpoint
# incomplete, so none is set here: set one only for the job it describes (a [[roots.runs]]
# rule), and `ckptd plan` warns when the checkpoints disagree with it. Configure with a
# config file mounted at /etc/ckptd/config.toml, or with CKPTD_* variables (they override the file).

FROM python:3.11-slim AS base
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# A non-root account. To delete what the trainer writes, ckptd usually runs with the
# trainer's uid:gid instead (compose `user:`, Kubernetes runAsUser): the state directory is
# writable by any uid for that reason (sticky, like /tmp).
RUN useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin ckptd \
 && mkdir -p /var/lib/ckptd /etc/ckptd \
 && chmod 1777 /var/lib/ckptd
# The journal, the per-root locks and the state file `ckptd health` reads.
ENV CKPTD_STATE_DIR=/var/lib/ckptd
WORKDIR /src
COPY pyproject.toml README.md ./
COPY ckptd ./ckptd
# Healthy while the daemon's heartbeat is fresh; the first scan of a big volume takes a while.
HEALTHCHECK --interval=30s --timeout=10s --start-period=2m --retries=3 CMD ["ckptd", "health"]
# Exec form: ckptd is PID 1 and gets `docker stop`'s SIGTERM itself (it stops within 10 s).
ENTRYPOINT ["ckptd", "run"]

FROM base AS deepspeed
# torch first, pinned, from PyTorch's CPU wheel index alone (as the README's test command does):
# PyPI's torch==2.13.0 is the multi-GB CUDA build. --no-deps: its dependencies come from PyPI
# with the next install, which keeps the installed 2.13.0+cpu.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX_URL" --no-deps torch==2.13.0 \
 && pip install '.[deepspeed,metrics,kubernetes]'
USER ckptd
WORKDIR /var/lib/ckptd

# The default target: the last stage.
FROM base AS slim
RUN pip install '.[metrics,kubernetes]'
USER ckptd
WORKDIR /var/lib/ckptd
