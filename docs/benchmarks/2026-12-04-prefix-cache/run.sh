# From the repository root: our server with its defaults (auto, --prefix-cache 512M), our server drafting with
# the draft model, and llama.cpp's server (built for this CPU, the same GGUF, one slot, its prompt cache on by
# default). Each server gets its cached peer first (a fresh cache: only the earlier conversations of that peer are
# in it), then its cold peer (cache_prompt false), all in one run.
set -x
LS=${LLAMA_SERVER:-llama-server}
specdecode serve --port 8101 > /tmp/ours.log 2>&1 &
OURS=$!
specdecode serve --port 8102 --spec-type draft > /tmp/ours-draft.log 2>&1 &
DRAFT=$!
$LS -m ~/.cache/specdecode/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf -t 2 -tb 2 -c 8192 -np 1 --port 8103 > /tmp/llama.log 2>&1 &
LL=$!
for port in 8101 8102 8103; do
  for i in $(seq 1 150); do curl -sf http://127.0.0.1:$port/health >/dev/null && break; sleep 2; done
done
python docs/benchmarks/multi_turn.py --conversations 8 --max-tokens 128 --dataset ../shared/data/mt_bench/question.jsonl \
  --peer ours=http://127.0.0.1:8101 --peer ours-cold=http://127.0.0.1:8101,cache=off \
  --peer ours-draft=http://127.0.0.1:8102 --peer ours-draft-cold=http://127.0.0.1:8102,cache=off \
  --peer llama.cpp=http://127.0.0.1:8103 --peer llama.cpp-cold=http://127.0.0.1:8103,cache=off \
  --out docs/benchmarks/2026-12-04-prefix-cache
kill $OURS $DRAFT $LL
