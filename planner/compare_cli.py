"""`trident compare plan.json run.json [--json] [--plot out.png]`: predicted against measured.

The prediction is the plan's own (what `trident plan` / `trident search` attached, and which
profiles priced it, in prediction.breakdown.priced_by). A plan without a prediction is priced
again: with --cluster-profile (default: the profile the plan names, planner.cluster.load_cluster)
and, if given, --model-profile (measured layer times, planner.model_profile). A profile whose hash
differs from the one the plan records is refused unless --allow-other-profile.
Entry point `main(argv) -> int` (0, or 2 with one line on stderr on bad input).
"""
from __future__ import annotations

import json
from pathlib import Path
import sys

from planner.model import ConfigError
from planner.args import OneLineParser, nonempty


def parse_args(argv):
    ap = OneLineParser(prog="trident compare", description=__doc__.splitlines()[0])
    ap.add_argument("plan")
    ap.add_argument("run")
    ap.add_argument("--json", action="store_true", help="print the comparison as JSON")
    ap.add_argument("--plot", type=nonempty, default=None, help="write a picture (predicted vs measured, timeline)")
    ap.add_argument("--cluster-profile", type=nonempty, default=None,
                    help="re-price with this cluster profile (name or path)")
    ap.add_argument("--model-profile", type=nonempty, default=None, help="re-price with this model profile (path)")
    ap.add_argument("--allow-other-profile", action="store_true",
                    help="re-price even when a profile's hash differs from the plan's")
    return ap.parse_args(argv)


def price(plan, args):
    """(prediction dict, timeline or None): the plan's own, or a fresh estimate."""
    from planner.cluster import load_cluster
    from planner.cost import estimate
    from planner.model_profile import load_model_profile

    if plan.prediction is not None and not (args.cluster_profile or args.model_profile):
        timeline = None
        if args.plot:  # the timeline is not stored; draw it when the plan's profiles are at hand
            try:
                timeline = estimate(plan, load_cluster(plan.cluster.name), keep_timeline=True).timeline
            except ConfigError:
                pass
        return plan.prediction, timeline
    try:
        cluster = load_cluster(args.cluster_profile or plan.cluster.name,
                               flag="--cluster-profile" if args.cluster_profile else "cluster.name")
    except ConfigError as exc:  # the plan names a measured profile that is not here: say how to give it
        raise ConfigError(f"{exc}" + ("" if args.cluster_profile else "; pass the profile it was priced with as "
                                      "--cluster-profile")) from None
    if plan.cluster.profile_hash and cluster.profile_hash != plan.cluster.profile_hash and not args.allow_other_profile:
        raise ConfigError(f"cluster.profile_hash: the plan was priced with another {plan.cluster.name} profile "
                          f"({plan.cluster.profile_hash[:19]}...); pass that profile with --cluster-profile or "
                          "--allow-other-profile")
    mp = load_model_profile(args.model_profile) if args.model_profile else None
    recorded = ((plan.prediction or {}).get("breakdown") or {}).get("priced_by", {}).get("model_profile")
    if mp is not None and recorded and recorded.get("hash") != mp.profile_hash and not args.allow_other_profile:
        raise ConfigError(f"--model-profile: the plan was priced with model profile {recorded.get('name')!r} "
                          "of another hash; pass that file or --allow-other-profile")
    est = estimate(plan, cluster, keep_timeline=bool(args.plot), model_profile=mp)
    return est.to_dict(), est.timeline


PLOT_FORMATS = (".png", ".pdf", ".svg")


def check_plot_path(path) -> None:
    if path is None:
        return
    p = Path(path)
    if p.suffix.lower() not in PLOT_FORMATS:
        raise ConfigError(f"--plot: {path} must end in {', '.join(PLOT_FORMATS)} (the picture's format)")
    if not p.parent.is_dir():
        raise ConfigError(f"--plot: the directory {p.parent} does not exist; create it or write elsewhere")


def main(argv=None) -> int:
    from planner.compare import compare, comparison_table, plot, read_run
    from planner.plan import Plan

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        check_plot_path(args.plot)
        plan = Plan.read(args.plan)
        run = read_run(args.run)
        prediction, timeline = price(plan, args)
        result = compare(plan, run, prediction)
    except ConfigError as exc:
        print(f"trident: error: {exc}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            plot(result, timeline, args.plot)
        except ConfigError as exc:
            print(f"trident: error: {exc}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(comparison_table(result))
        if args.plot:
            print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
