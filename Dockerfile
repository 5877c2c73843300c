# syntax=docker/dockerfile:1
# feedline: one image for the sampler sidecar and the trainer.
#
#   docker build -t feedline .                                   # GPU hosts: CUDA PyTorch runtime base
#   docker build --build-arg BASE_IMAGE=debian:bookworm-slim \
#                --build-arg TORCH_SPEC=torch==2.13.0 -t feedline:cpu .   # any Debian/Ubuntu with Python
#   docker build -f examples/Dockerfile -t my-training .        # your training code on top (docs/deployment.md)
#
# Build arguments:
#   BASE_IMAGE   the runtime base; the default carries CUDA and a CUDA build of torch
#   PYTHON       the base image's Python with torch (the pytorch images: /opt/conda/bin/python)
#   TORCH_SPEC   what to install when the base has no torch (ignored where it has one: that one is kept)
#   AVX2         1 builds pillow-simd with AVX2 (faster; crashes on CPUs without AVX2), 0 (default) SSE4
# Wheels placed in ./wheels (a torch CPU wheel, say) are used before any index.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime
ARG PYTHON=python3

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS build
ARG PYTHON
ARG TORCH_SPEC=""
ARG AVX2=0
ARG PILLOW_SIMD=12.1.1.post0
ENV DEBIAN_FRONTEND=noninteractive PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
RUN apt-get update \
 && apt-get install -y --no-install-recommends build-essential libjpeg-dev zlib1g-dev python3-dev python3-venv \
      ca-certificates \
 && rm -rf /var/lib/apt/lists/*
# The venv sees the base image's site-packages, so a CUDA torch there is used as it is.
RUN ${PYTHON} -m venv --system-site-packages /opt/feedline
ENV PATH=/opt/feedline/bin:$PATH
COPY wheels/ /wheels/
RUN if [ -n "$TORCH_SPEC" ] && ! python -c "import torch" 2>/dev/null; then \
      pip install --no-cache-dir --find-links /wheels "$TORCH_SPEC"; fi \
 && python -c "import torch; print('torch', torch.__version__)"
COPY pyproject.toml setup.py README.md /src/
COPY app /src/app
COPY deploy/image/install-feedline /usr/local/bin/
# The project asks for torch>=2.4 (a range the base satisfies); the install keeps the base's torch as
# it is and fails, rather than replace it, if anything would.
RUN install-feedline "/src[zstd,ray]" --find-links /wheels \
 && (pip uninstall -y pillow pillow-simd || true)
# torchrun of this environment: the base's own (/opt/conda/bin/torchrun) would start the ranks with a
# Python that cannot import feedline or the training code's packages installed here.
RUN printf '#!/bin/sh\nexec /opt/feedline/bin/python -m torch.distributed.run "$@"\n' >/opt/feedline/bin/torchrun \
 && chmod +x /opt/feedline/bin/torchrun
# pillow-simd last, compiled here against libjpeg-turbo, with plain Pillow gone.
RUN if [ "$AVX2" = "1" ]; then export CC="cc -mavx2"; else export CC="cc"; fi \
 && pip wheel --no-cache-dir --no-deps --no-binary pillow-simd -w /pillow "pillow-simd==${PILLOW_SIMD}"

# ---------------------------------------------------------------------------------------------------
FROM ${BASE_IMAGE} AS runtime
ARG PYTHON
ENV DEBIAN_FRONTEND=noninteractive
# tini from Debian/Ubuntu (the PyPI package of that name is unrelated); the JPEG runtime library only.
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini zlib1g ca-certificates \
      $(apt-cache show libjpeg62-turbo >/dev/null 2>&1 && echo libjpeg62-turbo || echo libjpeg-turbo8) \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/feedline /opt/feedline
COPY --from=build /pillow /pillow
ENV PATH=/opt/feedline/bin:$PATH PYTHONUNBUFFERED=1
RUN pip uninstall -y pillow >/dev/null 2>&1 || true \
 && pip install --no-cache-dir --no-deps /pillow/*.whl && rm -rf /pillow \
 && python -c "import PIL, PIL.features as f; \
assert '.post' in PIL.__version__, PIL.__version__; \
assert f.check_feature('libjpeg_turbo'), 'no libjpeg-turbo'; \
print('pillow-simd', PIL.__version__, 'with libjpeg-turbo')" \
 && python -c "from feedline.formats import fastjpeg; ok, why = fastjpeg.status(); assert ok, why; print(why)"
COPY deploy/prometheus /opt/feedline/deploy/prometheus
# The demo dataset's sample photos (compose --profile demo), so the demo store needs no network.
ARG DEMO_PHOTOS=1
RUN if [ "$DEMO_PHOTOS" = "1" ]; then \
      pip download -q --no-cache-dir --no-deps --only-binary=:all: scikit-image==0.26.0 -d /opt/feedline/share/photos; fi
RUN useradd --create-home --uid 10001 --user-group feedline \
 && mkdir -p /workspace /checkpoints && chown feedline:feedline /checkpoints
USER feedline
WORKDIR /home/feedline
# In containers the endpoints listen on all interfaces; the cache is the shared /dev/shm.
ENV FEEDLINE_METRICS_ADDR=0.0.0.0 FEEDLINE_CACHE=/dev/shm/feedline
EXPOSE 9101 9102
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD python -c "import os, urllib.request as u; \
p = os.environ.get('FEEDLINE_METRICS_PORT', '9101'); p = '9101' if p == '-1' else p; \
u.urlopen('http://127.0.0.1:%s/healthz' % p, timeout=2)"
ENTRYPOINT ["tini", "--", "feedline"]
CMD ["--help"]
