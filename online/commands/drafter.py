"""`livedraft drafter`: make drafters (init), warm-start an eagle head (train), export one (export)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from online.config import MIXED_PRECISION, load_config
from online.loading import add_model_arguments
from runtime.errors import LivedraftError

UNBOUNDED = 1_000_000  # --minutes without --steps: the time budget alone ends training


def training_steps(steps: int | None, minutes: float) -> int:
    """`drafter train`'s step cap: --steps where given; else none under a time budget (--minutes
    means train that long), else 600."""
    return steps if steps is not None else (UNBOUNDED if minutes > 0 else 600)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("drafter", help="drafter tools: init, train (eagle warm start), export, and the registry: "
                                           "register, list, promote, rollback")
    dsub = p.add_subparsers(dest="drafter_command", required=True)

    init = dsub.add_parser("init", help="a new drafter for a target: derived layers (model) or an EAGLE-3 head (eagle)")
    init.add_argument("--kind", choices=("model", "eagle"), default="model")
    init.add_argument("--from-target", required=True, help="target: directory, GGUF file or smollm2-135m")
    init.add_argument("--out", required=True, help="output directory")
    init.add_argument("--layers", type=int, help="model: how many of the target's first layers to keep")
    init.add_argument("--vocab-top", type=int, help="model: trim the LM head to the V most frequent tokens (VocabTrim)")
    init.add_argument("--vocab-text", help="text whose token frequencies choose the kept (model) or draft (eagle) "
                                           "vocabulary")
    init.add_argument("--draft-vocab", type=int, default=8192, help="eagle: draft vocabulary size (default 8192)")
    init.add_argument("--feature-layers", help="eagle: the 3 target layers whose input is fused, e.g. 2,15,27 "
                                               "(default: EAGLE-3's 2, L/2, L-3)")
    add_model_arguments(init)
    init.set_defaults(func=init_drafter)

    train = dsub.add_parser("train", help="warm-start an eagle head offline: the target answers prompts (or the log "
                                          "supplies traces), features are recomputed, the head is trained")
    train.add_argument("--target", required=True, help="directory, GGUF file or smollm2-135m")
    src = train.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompts", help=".txt (one per line) or .jsonl ({\"prompt\": ...}); the target answers them")
    src.add_argument("--traffic", help="logged traces: a store URL or a JSONL export")
    src.add_argument("--synthesize", type=int, metavar="N",
                     help="the target writes N user prompts itself (Magpie: sampled from its chat template's user "
                          "turn) and answers them: a head for a chat model before any traffic exists")
    train.add_argument("--out", required=True, help="output directory (an Eagle3 drafter)")
    train.add_argument("--init", help="start from this Eagle3 head instead of a new one")
    train.add_argument("--chat", action="store_true", help="wrap prompts in the tokenizer's chat template")
    train.add_argument("--max-new-tokens", type=int, default=64,
                       help="answer length for --prompts and --synthesize (default 64)")
    train.add_argument("--sampled", type=int, default=0, metavar="N",
                       help="--prompts/--synthesize: N more answers per training prompt, sampled at --temperature "
                            "(seeded), beside the greedy one: more data for the same prompts (held-out prompts get "
                            "only their greedy answer)")
    train.add_argument("--temperature", type=float, default=0.8,
                       help="temperature of the --sampled answers (default 0.8)")
    train.add_argument("--limit", type=int, help="--traffic: the most recent N traces")
    train.add_argument("--heldout", type=int, default=32, help="newest traces held out for the acceptance curve")
    train.add_argument("--minutes", type=float, default=0.0,
                       help="training time budget: trains until it is spent, or until --steps if given first "
                            "(0: --steps only)")
    train.add_argument("--steps", type=int, default=None,
                       help="optimizer steps (default 600; no limit with --minutes)")
    train.add_argument("--batch-size", type=int, default=8)
    train.add_argument("--lr", type=float, default=1e-3)
    train.add_argument("--draft-vocab", type=int, default=8192)
    train.add_argument("--mixed-precision", choices=MIXED_PRECISION,
                       help="bf16: the head's matmuls in bfloat16, weights and loss in fp32 (faster on CPUs with "
                            "AVX512-BF16/AMX and on GPUs; default: trainer.mixed_precision of the config)")
    train.add_argument("--k", type=int, default=4, help="draft length of the held-out replay (default 4)")
    train.add_argument("--eval-every", type=int, default=100, help="held-out replay every N steps (0: at the end)")
    train.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    add_model_arguments(train)
    train.set_defaults(func=train_drafter)

    export = dsub.add_parser("export", help="write a drafter in another engine's format")
    export.add_argument("dir", help="an eagle drafter directory (or a registry version's download)")
    export.add_argument("--format", choices=tuple(EXPORTERS), default="speculators",
                        help="speculators: vllm-project/speculators' Eagle3 layout, which vLLM's "
                             "--speculative-config loads; gguf: llama.cpp's EAGLE-3 GGUF, which "
                             "`llama-server -md FILE --spec-type draft-eagle3` loads")
    export.add_argument("--out", required=True, help="speculators: a new or empty directory; gguf: a new file")
    export.add_argument("--verifier", help="speculators: the target's name or path as vLLM should load it "
                                           "(default: what the head was made from)")
    export.add_argument("--target", help="gguf: the target whose tokenizer the head carries: its .gguf file (as "
                                         "llama-server loads it), a model directory or smollm2-135m (default: "
                                         "what the head was made from)")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                        help="weight precision (default float32: llama-server drafts exactly as livedraft)")
    export.set_defaults(func=export_drafter)

    reg = dsub.add_parser("register", help="register a drafter directory as a new version in the MLflow registry")
    reg.add_argument("dir", help="a model or eagle drafter directory")
    reg.add_argument("--alias", help="set this alias on the new version (champion: promote it; the old champion "
                                     "becomes previous)")
    reg.add_argument("--target-model", default="", help="recorded as the version's target_model tag")
    reg.add_argument("--data-dir", help="data directory (default: data_dir from the config)")
    reg.set_defaults(func=register_drafter)
    ls = dsub.add_parser("list", help="the registry's drafter versions, aliases, lineage and replay scores")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--data-dir", help="data directory (default: data_dir from the config)")
    ls.set_defaults(func=list_drafters)
    promote = dsub.add_parser("promote", help="make a version the champion (the old one becomes previous)")
    promote.add_argument("version", type=int)
    promote.add_argument("--data-dir", help="data directory (default: data_dir from the config)")
    promote.set_defaults(func=promote_drafter)
    back = dsub.add_parser("rollback", help="move champion back to the previous version (tags the one it leaves)")
    back.add_argument("--reason", default="manual rollback (livedraft drafter rollback)")
    back.add_argument("--data-dir", help="data directory (default: data_dir from the config)")
    back.set_defaults(func=rollback_drafter)


def init_drafter(args: argparse.Namespace) -> int:
    from online.loading import load_target

    cfg = load_config(args.config)
    target = load_target(args.from_target, cfg, args)
    if args.kind == "model":
        from runtime.derive import derive_drafter

        if args.layers is None:
            raise LivedraftError("--kind model needs --layers N (how many of the target's first layers to keep)")
        out = derive_drafter(target, args.layers, args.out, vocab_top=args.vocab_top, text_file=args.vocab_text)
        print(out)
        return 0
    from online.trainer.eagle import choose_draft_vocab, init_head, save_head

    corpus = []
    if args.vocab_text:
        text = Path(args.vocab_text)
        if not text.is_file():
            raise LivedraftError(f"vocab text file {text} does not exist")
        corpus = [target.tokenizer(line, add_special_tokens=False).input_ids
                  for line in text.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    layers = _layers(args.feature_layers)
    head = init_head(target, choose_draft_vocab(target, min(args.draft_vocab, target.vocab_size), corpus),
                     aux_layers=layers)
    out = Path(args.out)
    _check_empty(out)
    save_head(head, out, {"version": out.name, "derived_from": target.model_id,
                          "vocab_source": str(args.vocab_text) if args.vocab_text else "lowest ids"})
    print(out)
    return 0


def train_drafter(args: argparse.Namespace) -> int:
    import torch
    from tqdm import tqdm

    from online.commands.generate import encode, read_prompts
    from online.loading import load_target
    from online.trainer.warmstart import answered_traces, split_heldout, warm_start

    cfg = load_config(args.config)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.synthesize is not None and args.synthesize <= 0:
        raise LivedraftError(f"--synthesize needs a positive number of prompts, got {args.synthesize}")
    if args.sampled < 0 or (args.sampled and args.traffic):
        raise LivedraftError("--sampled needs a count >= 0 and answers to make (--prompts or --synthesize), "
                             f"got --sampled {args.sampled}" + (" with --traffic" if args.traffic else ""))
    if args.sampled and not args.temperature > 0:
        raise LivedraftError(f"--sampled needs --temperature > 0, got {args.temperature}")
    out = Path(args.out)
    _check_empty(out)
    target = load_target(args.target, cfg, args)
    if args.prompts or args.synthesize is not None:
        if args.prompts:
            if target.tokenizer is None:
                raise LivedraftError(f"target {args.target} has no tokenizer: give --traffic instead of --prompts")
            prompts = [encode(target.tokenizer, p, args.chat) for p in read_prompts(args.prompts)]
        else:
            from online.trainer.warmstart import synthesize_prompts

            bar = tqdm(total=args.synthesize, desc="target writes prompts", unit="prompt", file=sys.stderr)
            prompts = [encode(target.tokenizer, p, True)
                       for p in synthesize_prompts(target, args.synthesize, progress=bar.update)]
            bar.close()
        n_train = len(split_heldout(prompts, args.heldout)[0])
        bar = tqdm(total=len(prompts) + args.sampled * n_train, desc="target answers", unit="req", file=sys.stderr)
        train, heldout = answered_traces(target, prompts, args.max_new_tokens, heldout=args.heldout,
                                         sampled=args.sampled, temperature=args.temperature, progress=bar.update)
        bar.close()
    else:
        from online.replay.compare import load_traffic

        train, heldout = split_heldout(load_traffic(args.traffic, limit=args.limit), args.heldout)
    tcfg = cfg.trainer
    steps = training_steps(args.steps, args.minutes)
    tcfg.steps, tcfg.batch_size, tcfg.lr = steps, args.batch_size, args.lr
    tcfg.max_seconds, tcfg.draft_vocab = args.minutes * 60, args.draft_vocab
    tcfg.mixed_precision = args.mixed_precision or tcfg.mixed_precision
    bars: dict[str, tqdm] = {}
    held_mal = "-"

    def progress(event: str, data: dict) -> None:
        nonlocal held_mal
        if event == "features":
            bar = bars.setdefault("f", tqdm(total=data["total"], desc="target features", unit="trace", file=sys.stderr))
            bar.update(data["done"] - bar.n)
        elif event == "step":
            total = None if steps == UNBOUNDED else steps  # a time budget alone: a count, not a bar
            bar = bars.setdefault("s", tqdm(total=total, desc="training", unit="step", file=sys.stderr))
            bar.update(1)
            bar.set_postfix(loss=f"{data['loss']:.3f}", heldout_mal=held_mal)
        elif event == "eval":
            held_mal = f"{data['heldout_mean_acceptance_length']:.3f}"
            tqdm.write(f"step {data['step']}: held-out mean acceptance length {held_mal} (first token "
                       f"{data['heldout_first_token_acceptance']:.3f}) after {data['train_seconds']:.0f}s of training",
                       file=sys.stderr)

    t0 = time.perf_counter()
    res = warm_start(target, train, heldout, out, tcfg, init_dir=args.init, k=args.k, eval_every=args.eval_every,
                     on_progress=progress)
    for bar in bars.values():
        bar.close()
    last = res.curve[-1] if res.curve else None
    print(json.dumps({"out": str(out), "train_traces": res.train_traces, "heldout_traces": res.heldout_traces,
                      "steps": res.steps, "train_seconds": round(res.train_seconds, 1),
                      "total_seconds": round(time.perf_counter() - t0, 1),
                      "heldout_mean_acceptance_length": last.heldout_mean_acceptance_length if last else None}))
    return 0


def export_drafter(args: argparse.Namespace) -> int:
    from runtime.drafters.eagle import is_eagle_dir

    if not is_eagle_dir(args.dir):
        raise LivedraftError(f"{args.dir} is not an eagle drafter (no config.json with speculators_model_type "
                             f"'eagle3'): only eagle heads have a {args.format} export")
    print(EXPORTERS[args.format](args))
    return 0


def _export_speculators(args: argparse.Namespace) -> Path:
    from runtime.drafters.eagle import export_speculators

    if args.target:
        raise LivedraftError("--target is for --format gguf; a speculators export names its target with --verifier")
    return export_speculators(args.dir, args.out, verifier=args.verifier, dtype=args.dtype)


def _export_gguf(args: argparse.Namespace) -> Path:
    from runtime.drafters.eagle_gguf import export_gguf

    if args.verifier:
        raise LivedraftError("--verifier is for --format speculators; a GGUF head takes its target with --target")
    return export_gguf(args.dir, args.out, target=args.target, dtype=args.dtype)


EXPORTERS = {"speculators": _export_speculators, "gguf": _export_gguf}  # --format -> writer


def _layers(spec: str | None) -> list[int] | None:
    if spec is None:
        return None
    try:
        layers = [int(x) for x in spec.split(",")]
    except ValueError:
        raise LivedraftError(f"--feature-layers must be 3 comma-separated layer indices, got {spec!r}") from None
    if len(layers) != 3 or len(set(layers)) != 3:
        raise LivedraftError(f"--feature-layers must name 3 distinct target layers, got {spec!r}")
    return layers


def _check_empty(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise LivedraftError(f"output directory {out} is not empty: give a new or empty directory")


def _registry(args: argparse.Namespace):  # noqa: ANN202 - online.registry.DrafterRegistry, imported lazily
    from online.commands.daemon import apply_data_dir
    from online.registry import DrafterRegistry

    return DrafterRegistry.from_config(apply_data_dir(load_config(args.config), args.data_dir))


def register_drafter(args: argparse.Namespace) -> int:
    reg = _registry(args)
    version = reg.register(args.dir, alias=args.alias, target_model=args.target_model)
    print(f"{reg.name} version {version}{f' ({args.alias})' if args.alias else ''}: models:/{reg.name}/{version}")
    return 0


def list_drafters(args: argparse.Namespace) -> int:
    reg = _registry(args)
    history = reg.history()
    if args.json:
        print(json.dumps([v.to_dict() for v in history], indent=1))
        return 0
    if not history:
        print(f"{reg.name}: no versions yet (`livedraft drafter register DIR --alias champion`)")
        return 0
    print(f"{reg.name} ({reg.settings.tracking_uri})")
    print("version | aliases | kind | drafter | parent | held-out MAL candidate / champion | rolled back | created")
    for v in history:
        t = v.tags
        scores = (f"{t['candidate_mean_acceptance_length']} / {t['champion_mean_acceptance_length']}"
                  if "candidate_mean_acceptance_length" in t else "-")
        print(f"{v.version} | {','.join(v.aliases) or '-'} | {t.get('drafter_kind', '?')} | "
              f"{t.get('drafter_version', '?')} | {t.get('parent_version', '-')} | {scores} | "
              f"{t.get('rolled_back', 'false')} | {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(v.created_at))}")
    return 0


def promote_drafter(args: argparse.Namespace) -> int:
    reg = _registry(args)
    reg.promote(args.version)
    print(f"{reg.name}: champion is version {args.version}")
    return 0


def rollback_drafter(args: argparse.Namespace) -> int:
    reg = _registry(args)
    version = reg.rollback(args.reason)
    print(f"{reg.name}: rolled back; champion is version {version}")
    return 0
