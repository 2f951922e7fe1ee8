# From the repository root: our server (default settings: auto, --prefix-cache 512M) and llama.cpp's server
# (built for this CPU, the same GGUF, one slot, its prompt cache on by default), then four peers in one run.
set -x
LS=${LLAMA_SERVER:-llama-server}
specdecode serve --port 8101 > /tmp/ours.log 2>&1 &
OURS=$!
$LS -m ~/.cache/specdecode/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -t 2 -tb 2 -c 8192 -np 1 --port 8103 > /tmp/llama.log 2>&1 &
LL=$!
for i in $(seq 1 120); do curl -sf http://127.0.0.1:8101/health >/dev/null && curl -sf http://127.0.0.1:8103/health >/dev/null && break; sleep 2; done
python docs/benchmarks/multi_turn.py --conversations 8 --max-tokens 128 --dataset ../shared/data/mt_bench/question.jsonl \
  --peer ours=http://127.0.0.1:8101 --peer ours-cold=http://127.0.0.1:8101,cache=off \
  --peer llama.cpp=http://127.0.0.1:8103 --peer llama.cpp-cold=http://127.0.0.1:8103,cache=off \
  --out docs/benchmarks/2026-12-04-prefix-cache
kill $OURS $LL
