"""``bastion calibrate``: measure verify latency on this device, fit the roofline model, save a profile."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bastion.cli.parsing import positive_int_list
from bastion.utils.dtypes import CLI_DTYPES, parse_dtype, show_dtype_choices


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "calibrate",
        help="measure the target's verify latency on this device and save a latency profile",
        description=(
            "Time one target forward over trees of several sizes at several context lengths, fit the roofline "
            "latency model, print the fit error, save the profile (keyed by device and model) where pipelines "
            "look for it, and plot measured vs modelled latency."
        ),
    )
    p.add_argument("--target", default=None, help="target model directory or hub id (default: the demo target)")
    p.add_argument("--device", default="auto", help="device to measure on (default: auto, cuda when available, else cpu)")
    p.add_argument("--dtype", default="auto", choices=("auto", *CLI_DTYPES),
                   help="target dtype (default auto, as pipelines load it: the checkpoint's own, but float32 for "
                        "a float16 checkpoint on a CPU)")
    p.add_argument("--sizes", type=positive_int_list, default=[1, 2, 4, 8, 16, 32, 64, 128], help="tree sizes, e.g. 1,4,16,64")
    p.add_argument("--contexts", type=positive_int_list, default=[64, 512], help="context lengths, e.g. 64,512,2048")
    p.add_argument("--repeats", type=int, default=3, help="timed forwards per (size, context)")
    p.add_argument("--profile", default=None, help="profile JSON file (default: the user cache's latency_profiles.json)")
    p.add_argument("--no-save", action="store_true", help="fit and report without saving the profile")
    p.add_argument("--force", action="store_true", help="save the profile even when the fit is poor")
    p.add_argument("--plot", default="calibration.png", help="PNG to write (default: calibration.png)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import numpy as np

    from bastion.controllers.latency.calibrate import calibrate, plot_calibration
    from bastion.controllers.latency.profiles import default_profile_path
    from bastion.contract.errors import InvalidInputError
    from bastion.huggingface.causal_lm import HFTarget

    if args.repeats < 1:
        raise InvalidInputError(f"--repeats must be >= 1, got {args.repeats}")
    target_path = args.target
    if target_path is None:
        from bastion.demo import demo_paths

        target_path = str(demo_paths().target)
    show_dtype_choices()
    from bastion.cli.options import resolve_cli_device

    target = HFTarget.from_pretrained(target_path, device=resolve_cli_device(args.device), dtype=parse_dtype(args.dtype, allow_auto=True) or "auto")
    result = calibrate(target, args.sizes, args.contexts, repeats=args.repeats)
    model = result.model

    print(f"device: {model.device_label} (peaks from {model.peaks.source}: "
          f"{model.peaks.flops_per_s / 1e12:.3g} TFLOP/s, {model.peaks.bytes_per_s / 1e9:.3g} GB/s)")
    print(f"model:  {model.cost.signature}")
    print(f"{'n':>6} {'context':>8} {'measured ms':>12} {'model ms':>10} {'error':>7}")
    errors = result.rel_errors()
    for point, err in zip(result.points, errors):
        pred = model.predict(point.n_tokens, point.context_len)
        print(f"{point.n_tokens:>6} {point.context_len:>8} {point.seconds * 1e3:>12.3f} {pred * 1e3:>10.3f} {err:>7.1%}")
    p = model.params
    print(f"fit: a_c={p.a_c:.4g} b_c={p.b_c * 1e3:.4g}ms a_m={p.a_m:.4g} b_m={p.b_m * 1e3:.4g}ms")
    print(f"fit error: median {float(np.median(errors)):.2%}, max {float(errors.max()):.2%} over {len(errors)} points")
    bad = result.bad_fit()
    if bad:
        print(f"warning: {bad}", file=sys.stderr)
    if not args.no_plot:
        print(f"plot written: {plot_calibration(result, args.plot)}")
    if args.no_save:
        return 0
    if bad and not args.force:
        print("profile not saved (poor fit; --force saves it)", file=sys.stderr)
        return 1
    saved = model.save_profile(_profile_file(args.profile) if args.profile else default_profile_path())
    print(f"profile saved: {saved}")
    return 0


def _profile_file(profile: str) -> Path:
    """``--profile`` as a file: a folder means the profile file inside it (its lock and temporary files
    stay in that folder too)."""
    from bastion.controllers.latency.profiles import PROFILE_FILE

    path = Path(profile).expanduser()
    return path / PROFILE_FILE if path.is_dir() else path
