"""`specdecode train eagle3|mtp|dflash|dspark|vocab [--target MODEL] [--out DIR]`: a drafter trained for the user's own
model, offline (vocab: the tokens the target emits most, for a draft model's reduced head).

Two phases, both resumable (run the same command again): the target's features of text built from Python's
standard library (its own answers to prompts made from documented functions, and the library's source), kept
in a features folder that every drafter kind reads (CACHE/features/TARGET by default: train eagle3, then mtp,
and the target runs once); then the training-time test over them (training/loop.py), with held-out acceptance
on the progress bar and a checkpoint every --eval-every sequences. eagle3 writes a head in the reference
layout; mtp writes the target with its new MTP layers (a model folder, and a GGUF file for a GGUF target);
dflash writes a DFlash drafter in z-lab's layout (training/dflash.py: anchored blocks, not the unroll);
dspark a DSpark drafter in DeepSpec's layout (training/dspark.py: the same blocks, with its two heads).

The same command runs as torchrun's ranks (`torchrun ... -m specdecode train KIND`, or `--nproc N` on this host),
trains on hidden states vLLM wrote (`--vllm-hidden-states`), and writes vLLM's speculators layout on request
(`--speculators-layout`): docs/training.md.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from specdecode.drafters.registry import DRAFTERS, with_own_weights
from specdecode.errors import SpecDecodeError
from specdecode.models.formats.default_models import DEFAULT_TARGET
from specdecode.models.formats.drafter_folder import trained_folder

CHAT_PROMPT_LIMIT = 100_000  # far more than any budget answers; chat_prompts() never ends
# The drafters with weights of their own (the registry's, caps.draft_files) are the kinds trained here, each by
# training/<kind>.py's train_<kind>; vocab counts the target's tokens for a draft model's reduced head.
KINDS = (*with_own_weights(), "vocab")
BLOCK_KINDS = tuple(name for name in with_own_weights() if DRAFTERS[name].caps.block_size)  # anchored blocks


def add_parser(commands) -> None:
    train = commands.add_parser("train", help="train a drafter for a target on this machine (offline data)")
    train.add_argument("kind", choices=KINDS, help="the drafter to train; vocab: count the tokens the target "
                       "emits most in its own answers (--answers, --answer-tokens), which a draft model's "
                       "draft_vocab then drafts over")
    _add_target_args(train)
    _add_data_args(train)
    _add_drafter_args(train)
    _add_run_args(train)
    _add_scale_args(train)
    train.add_argument("--quiet", action="store_true", help="no progress bars")
    train.set_defaults(run=run)


def _add_target_args(train: argparse.ArgumentParser) -> None:
    """The target, where the results and the features go, and how the target runs."""
    group = train.add_argument_group("target")
    group.add_argument("--target", default=DEFAULT_TARGET, help=f"the target model (default {DEFAULT_TARGET})")
    group.add_argument("--out", help="folder for the checkpoints and the result (default: CACHE/KIND/TARGET_NAME, "
                       "where --spec-type auto finds an EAGLE-3 head; CACHE as for the default models)")
    group.add_argument("--features", help="folder for the target's features, shared by every drafter kind "
                       "(default: CACHE/features/TARGET_NAME)")
    group.add_argument("--dtype", default="auto", help="the target's dtype (as generate's --dtype)")
    group.add_argument("--quant", default="auto", help="the target's weights (as generate's --quant): train for "
                       "the target as you will run it")
    group.add_argument("--device", default="cpu", help="cpu or cuda[:N], for features and training")


def _add_data_args(train: argparse.ArgumentParser) -> None:
    """The training text: how many tokens, of which kinds, and how long."""
    group = train.add_argument_group("data")
    group.add_argument("--tokens", type=int, default=150_000, help="training tokens of features (default 150000: "
                       "with the defaults below, 1 to 1.5 hours on 2 CPU cores for a 1.5B target, measured; fewer "
                       "tokens shorten it)")
    group.add_argument("--held-out-tokens", type=int, default=6_000,
                       help="held-out tokens of each kind: answers, chat (when --chat-share asks for it) and code "
                       "(default 6000)")
    group.add_argument("--code-share", type=float, default=0.1,
                       help="share of the training tokens that is the standard library's source, teacher-forced; "
                       "the rest is the target's own answers to prompts (default 0.1: a drafter drafts the target's "
                       "answers, and learns them several times faster from answers than from code)")
    group.add_argument("--chat-share", type=float, default=0.5,
                       help="share of the target's answers (the tokens --code-share leaves) that answer chat-like "
                       "prompts (writing, role-play, reasoning, math, extraction, science, humanities, advice: "
                       "templates filled with topics the target lists itself); the rest answer standard-library "
                       "tasks (default 0.5: at the same budget, half each keeps most of what each alone teaches "
                       "on its own kind)")
    group.add_argument("--answers", type=int, default=48, help="vocab: prompts the target answers (default 48)")
    group.add_argument("--answer-tokens", type=int, default=384,
                       help="tokens per answer at most (default 384: most answers end by themselves)")
    group.add_argument("--max-len", type=int, default=768, help="tokens per training sequence at most (default 768)")


def _add_drafter_args(train: argparse.ArgumentParser) -> None:
    """The drafter's shape: its vocabulary, width, depth, blocks and heads."""
    group = train.add_argument_group("drafter")
    group.add_argument("--draft-vocab", type=int, default=16000,
                       help="draft vocabulary size (default 16000; published heads use 32000)")
    group.add_argument("--intermediate-size", type=int,
                       help="the head's MLP width (default: half the target's, to fit a CPU hour; published heads "
                       "use the target's)")
    group.add_argument("--num-layers", type=int,
                       help="mtp: modules to train (default 1; draft step k uses module min(k, K-1)); dflash, "
                       "dspark: draft layers (default 2)")
    group.add_argument("--block-size", type=int, default=8,
                       help="dflash, dspark: slots per block, the root included (default 8: on a CPU each verified "
                       "row costs; a DSpark block drafts all of them)")
    group.add_argument("--anchors", type=int, default=16,
                       help="dflash, dspark: blocks per training sequence (default 16)")
    group.add_argument("--markov-rank", type=int, default=256,
                       help="dspark: the Markov head's rank (default 256, as DeepSpec; 0 = none)")
    group.add_argument("--markov-head", choices=("vanilla", "gated", "rnn"), default="vanilla",
                       help="dspark: the Markov head's kind (default vanilla, as DeepSpec's released drafters)")


def _add_run_args(train: argparse.ArgumentParser) -> None:
    """The optimization: unroll, passes, learning rate, held-out measurements, batch."""
    group = train.add_argument_group("optimization")
    group.add_argument("--unroll", type=int, default=3, help="draft steps unrolled in training (default 3)")
    group.add_argument("--epochs", type=int, default=2)
    group.add_argument("--lr", type=float, default=3e-4)
    group.add_argument("--eval-every", type=int, default=100,
                       help="optimizer steps (of --batch sequences) between held-out measurements and checkpoints "
                       "(default 100)")
    group.add_argument("--batch", type=int,
                       help="sequences per optimizer step, all ranks together, a multiple of the ranks (default: "
                       "one per rank, or the batch of the checkpoint resumed); the same batch and seed give the "
                       "same steps on any number of ranks")


def _add_scale_args(train: argparse.ArgumentParser) -> None:
    """Beyond one process: torchrun's ranks, FSDP, vLLM's hidden states, speculators' layout."""
    group = train.add_argument_group("beyond one process")
    group.add_argument("--nproc", type=int,
                       help="train on N processes of this host: the command under torchrun (one per GPU with "
                       "--device cuda; gloo processes on the CPU); across hosts run torchrun yourself "
                       "(docs/training.md)")
    group.add_argument("--fsdp", action="store_true",
                       help="on several ranks, shard the drafter, its gradients and optimizer state over them "
                       "(FSDP) instead of a whole copy per rank (DDP, the default): for a drafter too large to copy")
    group.add_argument("--vllm-hidden-states", metavar="DIR",
                       help="train on hidden states vLLM wrote in speculators' offline layout (DIR/hs_N.safetensors, "
                       "docs/training.md) instead of computing features here: the target's forwards run in vLLM, "
                       "across its GPUs; each rank still loads the target, whole, for its embedding, final norm "
                       "and head")
    group.add_argument("--vllm-dataset", metavar="DIR",
                       help="with --vllm-hidden-states: speculators' prepared dataset (its loss masks; default: the "
                       "hidden states' parent folder, where speculators writes them); needs pyarrow")
    group.add_argument("--vllm-layer-ids",
                       help="with --vllm-hidden-states: the layer ids vLLM captured, comma-separated, the last layer "
                       "included (default: speculators' 2, L/2, L-3, L for a target of L layers)")
    group.add_argument("--speculators-layout", action="store_true",
                       help="eagle3, dflash, dspark: write the result in vLLM's speculators layout, which "
                       "speculators' own classes load (default: the kind's reference layout; both read here and "
                       "in vLLM)")


def check_args(args: argparse.Namespace) -> None:
    for name in ("tokens", "held_out_tokens", "answer_tokens", "max_len", "draft_vocab", "unroll", "epochs",
                 "eval_every", "anchors"):
        if getattr(args, name) < 1:
            raise SpecDecodeError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.answers < 0 or (args.intermediate_size is not None and args.intermediate_size < 1):
        raise SpecDecodeError("--answers must be >= 0 and --intermediate-size >= 1")
    for name in ("code_share", "chat_share"):
        if not 0 <= getattr(args, name) <= 1:
            raise SpecDecodeError(f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}")
    if args.max_len < 16:
        raise SpecDecodeError(f"--max-len must be at least 16 tokens, got {args.max_len}")
    if not 0 < args.lr < 1:
        raise SpecDecodeError(f"--lr must be in (0, 1), got {args.lr}")
    if args.num_layers is not None and (args.kind == "eagle3" or args.num_layers < 1):
        raise SpecDecodeError("--num-layers is for train mtp, dflash and dspark, and at least 1")
    if args.markov_rank < 0:
        raise SpecDecodeError(f"--markov-rank must be >= 0, got {args.markov_rank}")
    if args.kind == "mtp" and args.intermediate_size is not None:
        raise SpecDecodeError("--intermediate-size is for train eagle3, dflash and dspark (an MTP module keeps the "
                              "target's layer shape)")
    if not 2 <= args.block_size <= 33:
        raise SpecDecodeError(f"--block-size must be 2..33, got {args.block_size}")
    if (args.batch is not None and args.batch < 1) or (args.nproc is not None and args.nproc < 1):
        raise SpecDecodeError("--batch and --nproc must be at least 1")
    if args.kind == "vocab" and (args.nproc or args.fsdp or args.batch):
        raise SpecDecodeError("train vocab counts on one process: --nproc, --fsdp and --batch train drafters")
    if (args.vllm_dataset or args.vllm_layer_ids) and not args.vllm_hidden_states:
        raise SpecDecodeError("--vllm-dataset and --vllm-layer-ids go with --vllm-hidden-states")
    if args.speculators_layout and args.kind not in ("eagle3", *BLOCK_KINDS):
        raise SpecDecodeError("--speculators-layout is for train eagle3, dflash and dspark (MTP layers are written "
                              "into the target's own files)")
    if args.nproc and args.batch and args.batch % args.nproc:
        raise SpecDecodeError(f"--batch {args.batch} does not split over {args.nproc} processes: use a multiple "
                              f"of {args.nproc}")


def training_texts(chat: Iterable | None = None):
    """The standard library's tasks, chat-like prompts (training/chat_tasks.py; at most CHAT_PROMPT_LIMIT, as they
    never run out) and the code pieces taken in turn, in a fixed order (resume relies on it); extraction takes
    each kind until its token budget is met."""
    from specdecode.training.data import code_texts, prompts

    chat = itertools.islice(chat or [], CHAT_PROMPT_LIMIT)
    for texts in itertools.zip_longest(prompts(), chat, code_texts()):
        yield from (text for text in texts if text is not None)


def token_budget(args: argparse.Namespace) -> dict[tuple[str, str], int]:
    """Tokens of features per (split, kind): --code-share of the training tokens teacher-forced code, the rest the
    target's answers, --chat-share of them to chat-like prompts and the others to standard-library tasks;
    --held-out-tokens of each kind held out (of chat only when chat is trained on)."""
    code = round(args.tokens * args.code_share)
    chat = round((args.tokens - code) * args.chat_share)
    budget = {("train", "answer"): args.tokens - code - chat, ("train", "chat"): chat, ("train", "code"): code,
              ("held_out", "answer"): args.held_out_tokens, ("held_out", "code"): args.held_out_tokens,
              ("held_out", "chat"): args.held_out_tokens if chat else 0}
    return {key: tokens for key, tokens in budget.items() if tokens > 0}


def run(args: argparse.Namespace) -> int:
    check_args(args)
    from specdecode.models.loader import check_device
    from specdecode.training import ranks

    check_device(args.device)
    out = Path(args.out) if args.out else trained_folder(args.kind, args.target)
    if args.kind == "vocab":
        return count_vocabulary(args, out)
    if args.nproc:
        from specdecode.cli.torchrun import launch, without_nproc

        return launch(args.nproc, without_nproc(args.argv))
    here = ranks.from_environment()
    device = ranks.start(here, args.device)
    try:
        return train_drafter(args, out, device)
    except SpecDecodeError:
        if here.main:
            raise
        return 2  # every rank meets a user's error alike (ranks.main_first); rank 0 alone says it
    finally:
        ranks.stop()


def train_drafter(args: argparse.Namespace, out: Path, device: str) -> int:
    """Features, then training, on this rank (one of torchrun's, or the only one)."""
    from specdecode.models.loader import load_model
    from specdecode.training import ranks
    from specdecode.training.chat_tasks import chat_prompts, chat_topics
    from specdecode.training.eagle3 import feature_layer_ids
    from specdecode.training.features import check_manifest, extract
    from specdecode.training.loop import TrainSettings, describe

    here = ranks.current()
    features = Path(args.features) if args.features else \
        trained_folder("features-vllm" if args.vllm_hidden_states else "features", args.target)
    for folder in (out, features):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise SpecDecodeError(f"cannot write to {folder} ({error})") from None
    # Rank 0 first: a GGUF target is converted (or quantized) into the cache once, the others then read it.
    target = ranks.main_first(lambda: load_model(args.target, args.dtype, device, args.quiet or not here.main,
                                                 args.quant))
    if args.vllm_hidden_states:
        trained_on = from_vllm(args, target, features)
    else:
        layer_ids = feature_layer_ids(target.config.num_layers)
        budget = token_budget(args)
        chatting = ("train", "chat") in budget
        manifest = {"target": target.name, "quant": target.quant, "dtype": str(target.model.dtype),
                    "layer_ids": list(layer_ids), "answer_tokens": args.answer_tokens, "max_len": args.max_len,
                    "chat": chatting}  # chat prompts shift the texts' ordinals: a folder is made with them or not
        ranks.main_first(lambda: check_manifest(features, manifest))
        # Rank 0 has the target list its topics (sampled) once; every rank builds its prompts from the same file.
        chat = chat_prompts(ranks.main_first(lambda: chat_topics(target, features))) if chatting else None
        done = extract(target, layer_ids, training_texts(chat), features, budget, args.answer_tokens,
                       args.max_len, args.quiet, here)
        trained_on = sum(sum(tokens for (split, _), tokens in rank_done.items() if split == "train")
                         for rank_done in ranks.gathered(done))  # every rank's features written (and a barrier)
    mlp_width = args.intermediate_size or target.config.intermediate_size // 2
    settings = TrainSettings(draft_vocab=args.draft_vocab, intermediate_size=mlp_width if args.kind != "mtp" else None,
                             modules=args.num_layers or (2 if args.kind in BLOCK_KINDS else 1), steps=args.unroll,
                             block_size=args.block_size, anchors=args.anchors, markov_rank=args.markov_rank,
                             markov_kind=args.markov_head, epochs=args.epochs, lr=args.lr,
                             eval_every=args.eval_every, batch=args.batch, device=device, fsdp=args.fsdp)
    curve_file = out / "learning_curve.jsonl"

    def record(step: int, tokens: int, accuracy: dict[str, list[float]]) -> None:
        with curve_file.open("w" if step == 0 else "a") as curve:  # step 0: training starts afresh
            curve.write(json.dumps({"step": step, "tokens": tokens, "held_out_acceptance": accuracy}) + "\n")

    train = getattr(importlib.import_module(f"specdecode.training.{args.kind}"), f"train_{args.kind}")
    layout = {"speculators": True} if args.speculators_layout else {}
    result = train(target, features, out, settings, args.quiet or not here.main, record, **layout)
    if here.main:
        ranks_note = f", {here.world} ranks, batch {result['batch']}" if here.world > 1 else ""
        print(f"wrote {out} ({trained_on} training tokens, draft vocabulary {result['draft_vocab']}{ranks_note}); "
              f"{describe(result['held_out_accuracy'])}; use it with: {_usage(args, out)}", file=sys.stderr)
    return 0


def from_vllm(args: argparse.Namespace, target, features: Path) -> int:
    """Our features from the hidden states vLLM wrote (training/vllm_features.py), each rank converting its
    share of the samples -> training tokens, all ranks together."""
    from specdecode.training import ranks
    from specdecode.training.eagle3 import feature_layer_ids
    from specdecode.training.features import check_manifest
    from specdecode.training.vllm_features import convert, sample_files, sample_length

    hidden_states = Path(args.vllm_hidden_states)
    dataset = Path(args.vllm_dataset) if args.vllm_dataset else hidden_states.parent
    layers = target.config.num_layers
    try:
        layer_ids = sorted({int(i) for i in args.vllm_layer_ids.split(",")}) if args.vllm_layer_ids else \
            list(feature_layer_ids(layers))
    except ValueError:
        raise SpecDecodeError(f"--vllm-layer-ids must be comma-separated integers, got {args.vllm_layer_ids!r}"
                              ) from None
    if layer_ids[-1] != layers or layer_ids[0] < 0:
        raise SpecDecodeError(f"--vllm-layer-ids {layer_ids}: the last one must be the target's last layer, "
                              f"{layers} (the soft labels come from it; launch_vllm.py includes it by default)")

    def manifest() -> None:  # rank 0 reads every sample's length once: max_len sizes the drafters' rope tables
        longest = max(sample_length(path) for path in sample_files(hidden_states).values())
        check_manifest(features, {"source": "vllm", "target": target.name, "layer_ids": layer_ids,
                                  "max_len": longest})

    ranks.main_first(manifest)
    done, skipped = map(sum, zip(*ranks.gathered(convert(target, hidden_states, dataset, len(layer_ids), features,
                                                         ranks.current()))))
    if skipped and ranks.current().main:
        print(f"warning: {skipped} samples' token ids differ from their dataset rows and were skipped, as "
              "speculators skips them", file=sys.stderr)
    return done


def count_vocabulary(args: argparse.Namespace, out: Path) -> int:
    """`train vocab`: the target's emitted-token counts over its own answers, where a draft model's draft_vocab
    finds them (CACHE/vocab/TARGET_NAME, unless --out says otherwise)."""
    from specdecode.models.loader import load_model
    from specdecode.training.vocab_counts import count_answers, write_counts

    if not args.answers:
        raise SpecDecodeError("train vocab counts the target's answers: --answers must be at least 1")
    target = load_model(args.target, args.dtype, args.device, args.quiet, args.quant)
    counts, answered = count_answers(target, args.answers, args.answer_tokens, args.quiet)
    if not answered:
        raise SpecDecodeError(f"no prompt left room for a {args.answer_tokens}-token answer in {args.target}'s "
                              "context: lower --answer-tokens")
    path = write_counts(out, counts, target, answered)
    top = counts.sort(descending=True).values
    shares = ", ".join(f"the {n} most frequent {top[:n].sum() / max(1, int(counts.sum())):.1%}"
                       for n in (1000, 8000, 32000) if n < counts.numel())
    found = trained_folder("vocab", args.target)
    where = "" if out == found else f"; draft models read counts from {found} only"
    print(f"wrote {path}: {int(counts.sum())} tokens of {answered} answers, {int((counts > 0).sum())} distinct; "
          f"{shares} of them; a draft model with --draft-vocab N drafts over the N most frequent{where}",
          file=sys.stderr)
    return 0


def _usage(args: argparse.Namespace, out: Path) -> str:
    if args.kind == "eagle3" or args.kind in BLOCK_KINDS:
        auto = " (or --spec-type auto, which looks here)" if out == trained_folder(args.kind, args.target) else ""
        return f"specdecode generate \"...\" --model {args.target} --spec-type {args.kind} --draft-model {out}{auto}"
    model = next(iter(sorted(out.glob("*-mtp.gguf"))), out)  # the GGUF file keeps the target's own quantization
    companion = next(iter(sorted(out.glob("mtp-*.gguf"))), None)
    beside = f"; or --model {args.target} --draft-model {companion} (no second trunk)" if companion else ""
    return (f"specdecode generate \"...\" --model {model} --spec-type mtp --mtp-draft-vocab {args.draft_vocab} "
            f"(the vocabulary it was trained to draft over){beside}")
