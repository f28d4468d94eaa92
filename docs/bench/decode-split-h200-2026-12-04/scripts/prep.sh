# sourced at the top of every device command
[ -d .device/bin ] || tar -xJf .device/bin.tar.xz -C .device
source .device/env.sh
mkdir -p /work && ln -sfn $PWD/.device/data /work/shared
mkdir -p /work/main/build/bin && ln -sfn $(command -v berth) /work/main/build/bin/berth
