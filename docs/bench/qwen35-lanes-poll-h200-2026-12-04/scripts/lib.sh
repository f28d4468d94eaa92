source .device/prep.sh
w() { for i in $(seq 1 $2); do [ -f $1 ] && return 0; sleep 2; done; echo "waited for $1: missing"; return 1; }
B() { local f=/tmp/cur.txt; echo "== berth ${L:+LANES=$L }$*" | tee -a $OUT/all.txt; BERTH_GEMV_KQ_LANES=${L:-0} timeout 200 berth bench model -t 16 "$@" > $f 2>/dev/null; cat $f >> $OUT/all.txt; grep -E "^\| " $f | grep -v -E "^\| (model|---)" | awk -F'|' '{print $(NF-2),$(NF-1)}'; grep -E "HBM copy|reaches" $f | sed 's/.*HBM copy/HBM copy/' | head -2; }
I() { local f=/tmp/cur.txt; echo "== ik $*" | tee -a $OUT/all.txt; timeout 240 /tmp/ikb/bin/llama-bench -t 16 -o md "$@" > $f 2>/dev/null; cat $f >> $OUT/all.txt; grep -E "^\| " $f | grep -v -E "^\| (model|---)" | awk -F'|' '{print $(NF-2),$(NF-1)}'; }
