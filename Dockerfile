# megatron_md on NVIDIA's PyTorch container (docs/install.md, path c). The image's torch and Transformer
# Engine stay as NVIDIA built them: megatron_md and its other dependencies go in with the command of path (b),
# and the build fails if either changed version. Not built on our machines (they have no Docker engine).
#
#   docker build -t megatron-md:25.09 .
#   docker build --build-arg BASE_IMAGE=nvcr.io/nvidia/pytorch:25.12-py3 -t megatron-md:25.12 .
#
# megatron-core 0.19 and emerging-optimizers 0.3 require Python >= 3.12 (their Requires-Python); the
# NGC 25.x images are Ubuntu 24.04 with Python 3.12. Their torch is a pre-release build (25.09:
# 2.9.0a0+50eac811a6) that satisfies torch>=2.6; anything older than 2.6.0 (a 2.6.0a0 included) would not.
ARG BASE_IMAGE=nvcr.io/nvidia/pytorch:25.09-py3
FROM ${BASE_IMAGE}

RUN python -c "import sys; v = sys.version_info; assert v >= (3, 12), \
f'Python {v.major}.{v.minor}: megatron-core 0.19 needs 3.12 or newer; use a newer BASE_IMAGE'"

COPY . /opt/megatron_md

# The versions of torch and every Transformer Engine distribution, before and after: they must not move.
# --no-build-isolation: build megatron_md with the image's setuptools (nothing downloaded for the build,
# and the image's pip constraint file, PIP_CONSTRAINT, stays out of a build environment). That file, which
# pins what the image ships, stays in force for the install itself: a second guard on torch and TE.
RUN set -eux; \
    keep() { python -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformer[-_]engine[-_a-z0-9]*)==' | sort; }; \
    keep > /tmp/torch-te-before.txt; \
    cat /tmp/torch-te-before.txt; \
    cd /opt/megatron_md; \
    python -m pip install --no-cache-dir --no-build-isolation ".[gpu]"; \
    keep > /tmp/torch-te-after.txt; \
    diff /tmp/torch-te-before.txt /tmp/torch-te-after.txt; \
    python -c "import importlib.metadata as m; print('megatron-md', m.version('megatron-md'), 'megatron-core', m.version('megatron-core'))"

WORKDIR /workspace
