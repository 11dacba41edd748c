"""`tokenmill spec train-head`: a trained draft head (Medusa) for speculative decoding, cached per model."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser("spec", help="speculative decoding: train draft heads",
                                 description="Draft heads for speculative_config method \"medusa\".")
    actions = parser.add_subparsers(dest="spec_command", metavar="ACTION", required=True)
    train = actions.add_parser(
        "train-head", help="train a Medusa head on the model's own answers (cached)",
        description="Self-distillation: the model answers ShareGPT prompts greedily (the engine, batched), its "
                    "final hidden states along each answer are taken, and K Medusa heads (residual SiLU blocks "
                    "over the model's own LM head) learn the tokens 2..K+1 ahead with AdamW, all within --minutes "
                    "on --threads cores. The head is saved as safetensors + JSON into the cache beside the "
                    "converted model (or --out) and reused on later calls; use it with speculative_config "
                    '{"method": "medusa", "model": DIR}. The first 16 prompts of the seeded ShareGPT sample are '
                    "never trained on (held out for `tokenmill bench spec --scenarios s`).")
    train.add_argument("--model", default="smollm2-135m", help="model name or directory (default: smollm2-135m)")
    train.add_argument("--method", default="medusa", choices=("medusa",), help="head kind (default: medusa)")
    train.add_argument("--minutes", type=float, default=14.0,
                       help="time budget of generation and training (default: 14, so that loading and the "
                            "ShareGPT sample fit 20 minutes on 2 cores)")
    train.add_argument("--out", help="head directory (default: the cache's heads/<model>-medusa)")
    train.add_argument("--num-heads", type=int, default=4, help="K, the most drafts per step (default: 4)")
    train.add_argument("--max-prompts", type=int, default=2000, help="ShareGPT prompts at most (default: 2000)")
    train.add_argument("--max-tokens", type=int, default=256, help="tokens per answer (default: 256)")
    train.add_argument("--vocab-size", type=int, default=8192,
                       help="the heads predict the answers' most frequent tokens only (default: 8192)")
    train.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: 2)")
    train.add_argument("--force", action="store_true", help="train again even if the head is cached")
    train.set_defaults(handler=run_train_head)


def run_train_head(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from engine.model_loader import resolve_model
    from engine.spec_decode.medusa import CONFIG_FILE
    from tokenmill.spec_head import TrainSettings, head_dir_for, train_medusa_head

    model_dir = resolve_model(args.model)
    out = Path(args.out) if args.out else head_dir_for(model_dir, args.method)
    if (out / CONFIG_FILE).is_file() and not args.force:
        summary = json.loads((out / CONFIG_FILE).read_text()).get("training", {})
        print(f"cached head: {out} (trained: {summary}); --force trains again")
        return 0
    settings = TrainSettings(seconds=args.minutes * 60, num_heads=args.num_heads, vocab_size=args.vocab_size,
                             max_prompts=args.max_prompts, max_tokens=args.max_tokens, threads=args.threads)
    summary = train_medusa_head(model_dir, out, settings)
    print(f"head saved to {out}: {summary}")
    print(f'use it with speculative_config={{"method": "medusa", "model": "{out}"}}')
    return 0
