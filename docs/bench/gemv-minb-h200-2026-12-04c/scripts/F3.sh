# call 3: the device gates at this commit
source .device/prep.sh
t0=$(date +%s)
timeout -k 5 560 bash scripts/gpu-gates.sh $OUT/gates; echo "gates rc $? in $(( $(date +%s) - t0 )) s"
