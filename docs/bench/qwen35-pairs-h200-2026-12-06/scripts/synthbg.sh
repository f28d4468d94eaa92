# background: synthesize the benchmark files, each with a .done marker
source .device/prep.sh
V=/work/shared/tokenizers/qwen3/tokenizer.json
s() { local out=$1; shift; [ -f $out.done ] && return; nice -n 5 berth synth "$@" -s 1 -t 16 -o $out > $out.log 2>&1 && date +%s > $out.done; }
s /dev/shm/q08.gguf --preset qwen3.5-0.8b --type q4_k_m --vocab $V
s /dev/shm/q4b.gguf --preset qwen3.5-4b --type q4_k_m --vocab $V
s /dev/shm/q27.gguf --preset qwen3.5-27b --type q4_k_m --vocab $V
s /tmp/q35.gguf --preset qwen3.5-35b-a3b --type q4_k_m --vocab $V
date +%s > /tmp/synth.alldone
