# ember's own build image: the kernel toolchain that .ci/setup-kernels.sh installs on a host
# (Debian's clang-19/lld-19/llvm-19, the HIP headers of libamdhip64-dev, the assembled ROCm device
# libraries) and the C toolchain that links the engine. Built by `cargo xtask build --in-container
# --build-base BASE` (xtask/src/container.rs), which copies this file and .ci/setup-kernels.sh into
# a build context of their own and tags the image `ember-build:<digest of both and of the base>`.
#
# CI builds it on the debootstrapped Debian base that .ci/setup-docker.sh makes, where the official
# `rocm/dev-*` images (the default build image, from targets.toml) cannot be pulled. Packages come
# from the base's own apt sources, the only network the base provides; the container builds
# themselves run with no network at all.
#
# No Rust toolchain is installed here on purpose: xtask mounts the host's rustup toolchain
# read-only at the path it has on the host, so the host and the container compile with the very
# same rustc (their artifacts can then be compared byte for byte) and nothing is downloaded into
# the image. The official images are used the same way.
ARG BASE_IMAGE
FROM ${BASE_IMAGE}

ARG BASE_IMAGE
LABEL org.opencontainers.image.title="ember-build" \
      org.opencontainers.image.description="ember's build image: AMDGPU kernel toolchain and C linker (the Rust toolchain is mounted from the host)" \
      org.opencontainers.image.base.name="${BASE_IMAGE}"

ENV DEBIAN_FRONTEND=noninteractive \
    EMBER_TOOLCHAIN_DIR=/opt/ember-toolchain

COPY setup-kernels.sh /opt/ember-setup/setup-kernels.sh
# One apt transaction for the linker and what setup-kernels.sh would install, then the script
# assembles the device libraries (it finds its packages present and installs nothing more).
RUN set -eu; \
    apt-get update -q; \
    apt-get install -y -q --no-install-recommends ca-certificates gcc libc6-dev \
        clang-19 lld-19 llvm-19 libamdhip64-dev; \
    bash /opt/ember-setup/setup-kernels.sh; \
    chmod -R a+rX /opt/ember-toolchain; \
    rm -rf /var/lib/apt/lists/* /opt/ember-toolchain/apt
