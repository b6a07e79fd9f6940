"""`lit-parallel consolidate`: a sharded checkpoint -> one full ``state_dict`` file (or, with
``--lightning``, one full Lightning checkpoint), see :mod:`lit_parallel.checkpoint.convert`."""

from __future__ import annotations

import argparse

from lit_parallel.checkpoint.convert import consolidate, consolidate_checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint", help="sharded checkpoint folder (saved by fsdp_blocks / hsdp)")
    parser.add_argument("output", help="full state_dict file to write (torch.save)")
    parser.add_argument("--key", default="state_dict", help="entry holding the weights (default: state_dict)")
    parser.add_argument(
        "--strip-prefix",
        default=None,
        help="keep only keys with this prefix and remove it, e.g. 'model.' for the module stored as self.model",
    )
    parser.add_argument(
        "--lightning",
        action="store_true",
        help="write a full Lightning checkpoint (weights, optimizer state, loops, RNG states) to resume from with"
        " ckpt_path= under ddp_tuned or on one device",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an existing output file (never a folder; the output may not be inside the checkpoint)",
    )


def run(args: argparse.Namespace) -> int:
    if getattr(args, "lightning", False):
        checkpoint = consolidate_checkpoint(
            args.checkpoint, args.output, overwrite=getattr(args, "overwrite", False)
        )
        state = checkpoint["state_dict"]
        print(
            f"wrote {args.output}: a full Lightning checkpoint, {len(state)} tensors,"
            f" {len(checkpoint['optimizer_states'])} optimizer state(s), epoch {checkpoint.get('epoch')},"
            f" step {checkpoint.get('global_step')}"
        )
        return 0
    state = consolidate(
        args.checkpoint,
        args.output,
        key=args.key,
        strip_prefix=args.strip_prefix,
        overwrite=getattr(args, "overwrite", False),
    )
    numel = sum(v.numel() for v in state.values())
    nbytes = sum(v.numel() * v.element_size() for v in state.values())
    print(f"wrote {args.output}: {len(state)} tensors, {numel:,} elements, {nbytes / 2**20:.2f} MiB")
    return 0
