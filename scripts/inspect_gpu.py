"""Compile a run's GPU programs on this machine, without a GPU, and say what they cost.

    python scripts/inspect_gpu.py --config configs/qwen3_8b_shape.yaml --target h100 \\
        --batches 1,64 --context 2048 --json gpu.json --hlo-dir hlo/
    python scripts/inspect_gpu.py --config configs/qwen3_8b_eagle3.yaml --target h100 \\
        --devices 8 --programs grpo_score,grpo_update --json grpo.json

Needs jax's CUDA plugin (`pip install -e ".[gpu-aot]"`, ~3 GB); no GPU. Programs
(jaxspec.gpu_targets.inspect): decode, verify_k3, tree_n16, refill, eagle3_draft, block_draft (one
device, at each batch), grpo_score and grpo_update (the run's batch on --devices GPUs, fsdp).
Per program: HBM bytes per loop iteration estimated from the optimized HLO
(jaxspec.gpu_targets.hlo) against the floor (weights + live KV read once; training: also
the model-FLOPs time), copies over 1 MB in the loop body with their jax origin, kernels
per iteration (and how many run inside a CUDA-graph command buffer), and XLA's memory per
device, and a time per iteration estimated per kernel (jaxspec.gpu_targets.estimate: the
larger of FLOPs over the peak and bytes over the bandwidth, plus a launch cost), with a
profile's measured times beside it (--profile). Each program's optimized HLO goes to --hlo-dir.

Communication (jaxspec.gpu_targets.collectives), a table per program that has any: every
collective of the optimized HLO by kind and mesh axis, its bytes and executions per run,
its time at the target's link bandwidth (ring algorithm), how much of it XLA's schedule
leaves exposed (not overlapped with compute), and beside it the model-FLOPs time; in
--json as each report's "communication".
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


def _parse(argv):
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__)
    p.add_argument("--config", required=True, help="a run config (YAML)")
    p.add_argument("--target", required=True, help="h100, h200 or gb200")
    p.add_argument("--devices", type=int, default=8, help="GPUs of the GRPO programs' mesh")
    p.add_argument("--expert", type=int, default=1,
                   help="the GRPO programs' expert-parallel axis (an MoE policy); fsdp takes "
                        "the rest of --devices")
    p.add_argument("--batches", default="1,64", help="comma list of decode batch sizes")
    p.add_argument("--context", type=int, default=2048, help="live KV slots per row (= cache capacity)")
    p.add_argument("--prompt-len", type=int, default=None,
                   help="refill prompt tokens per row (default: rollout.max_prompt_len, at most --context)")
    p.add_argument("--programs", default=None,
                   help="comma list (default: decode,verify_k3,tree_n16,refill,eagle3_draft,block_draft)")
    p.add_argument("--layer-loop", default=None, help="override model.layer_loop: auto, scan or unroll")
    p.add_argument("--xla", action="append", default=[], metavar="OPTION=VALUE",
                   help="an XLA compile option for every program (repeatable), on top of (and over) "
                        "the ones the engine compiles with on a GPU (kernels.compiler_options)")
    p.add_argument("--json", default=None, help="write the reports here")
    p.add_argument("--hlo-dir", default=None, help="write each program's optimized HLO here")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="a GPU profile's JSON (scripts/gpu_profile.py): its measured time per "
                        "kernel beside the estimate, the kernels furthest over it first")
    p.add_argument("overrides", nargs="*", help="config overrides a.b=c")
    return p.parse_args(argv)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def model_config(cfg):
    """The run's ModelConfig: from model.hf_path's config.json when that directory exists,
    else from the model section's fields (vocab_size required)."""
    from jaxspec.models.hf import config_from_hf

    spec = cfg.model
    if spec.hf_path is not None and os.path.isdir(spec.hf_path):
        with open(os.path.join(spec.hf_path, "config.json")) as fh:
            hf = json.load(fh)
        return config_from_hf(hf, dtype=spec.dtype, attention_backend=spec.attention_backend
                              ).replace(layer_loop=spec.layer_loop)
    if spec.vocab_size is None:
        raise ValueError(f"model.hf_path {spec.hf_path!r} is not a directory here and "
                         f"model.vocab_size is not set: the config gives no architecture")
    return spec.model_config(spec.vocab_size)


def run_settings(cfg) -> dict:
    """The GRPO programs' settings from the run config."""
    return dict(
        batch=cfg.rollout.prompts_per_step * cfg.rollout.group_size,
        prompt_len=cfg.rollout.max_prompt_len, new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.sampling.temperature, top_k=cfg.sampling.top_k, top_p=cfg.sampling.top_p,
        kl_coef=cfg.grpo.kl_coef, chunk=cfg.grpo.logprob_chunk, micro_batch=cfg.grpo.micro_batch,
        capture=cfg.draft.kind == "eagle3",
        optim=dict(lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay, b1=cfg.optim.b1,
                   b2=cfg.optim.b2, clip_norm=cfg.optim.clip_norm),
    )


def _row(r: dict) -> str:
    gb = 1e9
    th = r["thunks"] or {}
    copies = len(r["copies_over_1mb"])
    ratio = f"{r['ratio']:.3f}x" if r["ratio"] is not None else "-"
    mem = r["memory_per_device"]["total"] / gb
    extra = f"  flops-bound {r['flops_time_ms']:.0f} ms" if "flops_time_ms" in r else ""
    return (f"{r['program']:<13} {r.get('batch') or '-':>5} {r['bytes'] / gb:>9.3f} "
            f"{r['floor'] / gb:>9.3f} {ratio:>8} {copies:>6} {r['kernels_hlo']:>7} "
            f"{th.get('kernels', '-'):>6} {th.get('in_command_buffer', '-'):>6} "
            f"{mem:>8.2f} {r['estimate']['time_ms']:>8.3f}  ({r['compile_s']:.0f} s){extra}")


def communication(report: dict, hlo_text: str, mesh, target) -> dict:
    """The program's collectives summarised (jaxspec.gpu_targets.collectives.summarize)
    on `mesh` at `target`'s link bandwidth, beside its model-FLOPs time when it has one."""
    from jaxspec.gpu_targets import collectives, hlo

    found = collectives.collectives(hlo.parse(hlo_text), dict(mesh.shape), target.link_bandwidth)
    flops_s = report["flops_time_ms"] / 1e3 if "flops_time_ms" in report else None
    out = collectives.summarize(found, flops_s)
    out.update(link=target.link, link_bandwidth=target.link_bandwidth)
    return out


def _comm_table(r: dict) -> list[str]:
    c = r["communication"]
    head = (f"communication in {r['program']} ({r['devices']} x {r['target']}, {c['link']} "
            f"{c['link_bandwidth'] / 1e9:.0f} GB/s per direction): {c['executions']:,} "
            f"collectives, {c['bytes'] / 1e9:,.1f} GB, {c['seconds']:.2f} s "
            f"({c['exposed_seconds']:.2f} s not overlapped)")
    if "flops_seconds" in c:
        head += (f"; model-FLOPs {c['flops_seconds']:.2f} s: ratio {c['ratio_to_flops']:.3f} "
                 f"(exposed {c['exposed_ratio_to_flops']:.3f})")
    lines = [head, f"  {'kind':<19} {'axes':<12} {'instrs':>6} {'runs':>8} {'GB':>10} "
                   f"{'s':>8} {'exposed s':>9}"]
    for k in c["by_kind"]:
        lines.append(f"  {k['kind']:<19} {k['axes'] or '-':<12} {k['instructions']:>6} "
                     f"{k['executions']:>8,} {k['bytes'] / 1e9:>10,.1f} {k['seconds']:>8.3f} "
                     f"{k['exposed_seconds']:>9.3f}")
    for x in c["largest"][:6]:
        lines.append(f"  largest: {x['kind']} {x['bytes'] / 1e6:,.1f} MB x{x['count']} over "
                     f"{x['axes'] or '-'} (n={x['group_size']}) {x['total_seconds']:.3f} s"
                     f"{' overlapped' if x['overlapped'] else ''} from "
                     f"{x['op_name'][-70:] or '?'}")
    return lines


def _measured(path, program: str, batch):
    """The profile's kernels of `program` at `batch` (None: no --profile, or not profiled)."""
    from jaxspec.gpu_targets import estimate

    return estimate.load_profile(path, program, batch) if path else None


def _measured_lines(r: dict) -> list[str]:
    m = r["measured"]
    lines = [f"measured in {r['program']} (batch {r.get('batch')}): {m['matched']} of "
             f"{m['estimated_kernels']} kernels matched, {m['measured_us']:,.0f} us measured "
             f"against {m['estimated_us']:,.0f} us estimated per iteration; "
             f"{m['unmatched_measured_us']:,.0f} us in kernels the HLO does not name"]
    for k in m["furthest"][:8]:
        ratio = f"{k['ratio']:.1f}x" if k["ratio"] else "-"
        lines.append(f"  {k['name']:<32} {k['measured_us']:>9.1f} us vs {k['estimated_us']:>8.1f} "
                     f"({ratio}, {k['bound']}) {k['op_name'][-60:]}")
    return lines


def main(argv=None) -> int:
    args = _parse(argv)
    from jaxspec import gpu_targets
    from jaxspec.timing import positive_ints

    if args.target not in gpu_targets.TARGETS:
        return _fail(f"--target {args.target!r} is unknown; valid: {', '.join(gpu_targets.TARGETS)}")
    try:
        batches = positive_ints(args.batches, "batches")
        if args.context < 16:
            raise ValueError(f"--context {args.context}: must be >= 16")
        if args.devices < 1:
            raise ValueError(f"--devices {args.devices}: must be >= 1")
        if args.expert < 1 or args.devices % args.expert:
            raise ValueError(f"--expert {args.expert}: must be >= 1 and divide --devices "
                             f"{args.devices}")
        from jaxspec.gpu_targets.inspect import DECODE_PROGRAMS, PROGRAMS

        programs = (args.programs.split(",") if args.programs else list(DECODE_PROGRAMS))
        bad = [p for p in programs if p not in PROGRAMS]
        if bad:
            raise ValueError(f"--programs {','.join(bad)} unknown; valid: {', '.join(PROGRAMS)}")
        if args.profile is not None:
            with open(args.profile) as fh:  # an OSError or JSONDecodeError (a ValueError)
                if "cases" not in json.load(fh):
                    raise ValueError(f"--profile {args.profile}: no 'cases' (not a "
                                     f"scripts/gpu_profile.py JSON)")
        if args.layer_loop not in (None, "auto", "scan", "unroll"):
            raise ValueError(f"--layer-loop {args.layer_loop!r}; valid: auto, scan, unroll")
        xla = {}
        for item in args.xla:
            key, sep, value = item.partition("=")
            if not sep or not key.startswith("xla_"):
                raise ValueError(f"--xla {item!r}: want OPTION=VALUE with an xla_ option name")
            xla[key] = value
        gpu_targets.check_plugin()
    except (ValueError, OSError, gpu_targets.PluginMissingError) as e:
        return _fail(str(e))
    from jaxspec.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides, check_paths=False)
        model = model_config(cfg)
    except (ConfigError, ValueError, OSError) as e:
        return _fail(str(e))
    if args.layer_loop is not None:
        model = model.replace(layer_loop=args.layer_loop)
    from jaxspec.kernels import jax_triton_available

    if model.attention_backend == "triton" and not jax_triton_available():
        return _fail("model.attention_backend='triton' needs jax-triton, which does not import "
                     "here (pip install -e '.[gpu]' beside the CUDA plugin); or inspect the "
                     "Pallas kernel instead: add the override model.attention_backend=auto")
    prompt_len = min(args.prompt_len or cfg.rollout.max_prompt_len, args.context)

    import tempfile

    from jaxspec import parallel
    from jaxspec.gpu_targets.inspect import build_program, inspect_program

    scratch = tempfile.TemporaryDirectory()
    hlo_dir = args.hlo_dir or scratch.name  # the collectives are read back from the HLO
    gpu = gpu_targets.target(args.target)

    print(f"{gpu_targets.target(args.target).description}: {args.config}, {model.num_layers} "
          f"layers, {model.dtype}, layer_loop={model.layer_loop}, context {args.context}",
          flush=True)
    print(f"{'program':<13} {'batch':>5} {'GB/iter':>9} {'floor GB':>9} {'ratio':>8} "
          f"{'copies':>6} {'kernels':>7} {'thunks':>6} {'in CB':>6} {'GB/dev':>8} {'est ms':>8}", flush=True)
    reports = []
    one = gpu_targets.mesh(args.target, {"data": 1, "fsdp": 1, "expert": 1, "tensor": 1})
    for name in programs:
        if name.startswith("grpo"):
            mesh = gpu_targets.mesh(args.target, {"data": 1, "fsdp": args.devices // args.expert,
                                                  "expert": args.expert, "tensor": 1})
            tag = f"{name}_{args.target}_x{args.devices}"
            with parallel.use_rules(cfg.mesh.rules):  # the run's sharding rules
                program = build_program(name, model, batch=0, context=args.context, mesh=mesh,
                                        run=run_settings(cfg))
                report = inspect_program(program, args.target, mesh, hlo_dir=hlo_dir, tag=tag,
                                         xla_options=xla,
                                         measured=_measured(args.profile, name, None))
            report["batch"] = run_settings(cfg)["batch"]
            report["communication"] = communication(
                report, open(os.path.join(hlo_dir, f"{tag}.hlo.txt")).read(), mesh, gpu)
            reports.append(report)
            print(_row(report), flush=True)
            continue
        for batch in batches:
            program = build_program(name, model, batch=batch, context=args.context, mesh=one,
                                    prompt_len=prompt_len,
                                    draft_vocab=cfg.draft.draft_vocab_size or 32_000)
            tag = f"{name}_b{batch}_{args.target}_{model.layer_loop}"
            report = inspect_program(program, args.target, one, hlo_dir=hlo_dir, tag=tag,
                                     xla_options=xla,
                                     measured=_measured(args.profile, name, batch))
            report["communication"] = communication(
                report, open(os.path.join(hlo_dir, f"{tag}.hlo.txt")).read(), one, gpu)
            report.update(batch=batch, context=args.context, layer_loop=model.layer_loop,
                          config=args.config)
            reports.append(report)
            print(_row(report), flush=True)
    for r in reports:
        for c in r["copies_over_1mb"]:
            print(f"  copy in {r['program']} (batch {r.get('batch')}): {c['bytes'] / 1e6:.1f} MB "
                  f"x{c['count']} {c['kind']} from {c['op_name'] or '?'}")
    for r in reports:
        if r["communication"]["instructions"]:
            print("\n".join(_comm_table(r)))
    scratch.cleanup()
    for r in reports:
        if "measured" in r:
            print("\n".join(_measured_lines(r)))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(reports, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
