source .device/prep.sh
w() { for i in $(seq 1 $2); do [ -f $1 ] && return 0; sleep 2; done; echo "waited for $1: missing"; return 1; }
# B: berth bench model; I: ik_llama.cpp's llama-bench. Every output goes to $OUT/all.txt.
B() { local f=/tmp/cur.txt; echo "== berth $* [$(date +%T)]" | tee -a $OUT/all.txt; timeout 300 berth bench model -t 16 "$@" > $f 2>/tmp/cur.err; echo "rc $?" >> $OUT/all.txt; cat $f >> $OUT/all.txt; grep -E "^\| " $f | grep -v -E "^\| (model|---)" | awk -F'|' '{print $(NF-2),$(NF-1)}'; grep -E "HBM copy|reaches|DRAM [0-9]|distinct" $f | head -4; tail -2 /tmp/cur.err | grep -i error; }
I() { local f=/tmp/cur.txt; echo "== ik $* [$(date +%T)]" | tee -a $OUT/all.txt; timeout 300 /tmp/ikb/bin/llama-bench -t 16 -o md "$@" > $f 2>/tmp/cur.ikerr; echo "rc $?" >> $OUT/all.txt; cat $f >> $OUT/all.txt; grep -E "^\| " $f | grep -v -E "^\| (model|---)" | awk -F'|' '{print $(NF-2),$(NF-1)}'; tail -2 /tmp/cur.ikerr | grep -i -E 'error|fail'; }
