"""``jascl text-embeddings``: write the CLIP text embeddings of a protocol's class names from local CLIP weights.

The file (safetensors, ``class name -> vector``) is what the ``clip-driven`` backbone
(``backbone_args.embeddings``) and the CLIP methods (``method_args.<method>.embeddings``) read; its
metadata lists the protocol's classes in classifier-row order (background first), the protocol, the
template and the weights. Nothing is downloaded: the weights are a local file or open_clip folder.
"""

from __future__ import annotations

import argparse
import json


def add_text_embeddings_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``text-embeddings`` (torch and open_clip are imported only when it runs)."""
    p = subparsers.add_parser(
        "text-embeddings",
        help="write the CLIP text embeddings of a protocol's class names (local CLIP weights, nothing downloaded)",
    )
    p.add_argument(
        "--weights",
        required=True,
        help="local CLIP weights: a .safetensors/.bin/.pth/.pt file of the --model architecture, or an open_clip "
        "folder (open_clip_config.json + weights)",
    )
    p.add_argument("--protocol", required=True, help="built-in protocol name or YAML path")
    p.add_argument("--out", required=True, help="the .safetensors file to write")
    p.add_argument(
        "--model",
        default="ViT-B-32",
        help="open_clip architecture of a weights file (default ViT-B-32; ViT-B-32-quickgelu for OpenAI's weights)",
    )
    p.add_argument("--template", default=None, help='prompt with one {} (default "A computerized tomography of a {}.")')
    p.set_defaults(func=cmd_text_embeddings)
    return p


def cmd_text_embeddings(args: argparse.Namespace) -> int:
    from jascl.networks.text_embeddings import DEFAULT_TEMPLATE, ROWS_KEY, encode_class_names, write_text_embeddings
    from jascl.protocols import get_protocol

    protocol = get_protocol(args.protocol)
    rows = [protocol.class_name(c) for c in protocol.seen_classes(len(protocol.sessions) - 1)]
    template = args.template or DEFAULT_TEMPLATE
    vectors = encode_class_names(rows[1:], args.weights, template, model=args.model)
    metadata = {
        ROWS_KEY: json.dumps(rows),
        "protocol": protocol.name,
        "template": template,
        "weights": str(args.weights),
        "model": args.model,
    }
    write_text_embeddings(args.out, dict(zip(rows[1:], vectors, strict=True)), metadata)
    print(f"{args.out}: {len(rows) - 1} class embeddings of dimension {vectors.shape[1]} for protocol {protocol.name}")
    return 0
