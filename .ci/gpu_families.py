"""`make gpu-check`, step 2: the whole pipeline on a tiny model of every hub family the recipes name, on CUDA with bf16
compute (SFT → CODI → GKD → GRPO → eval, text and latent; `latent_rl.fixtures`), in one process so CUDA starts once.
One PASS / FAIL line a family, seconds and the two evaluations in --json. Runs on the CPU too (`--device cpu`: fp32),
which is how it is checked where no GPU is lent."""
import argparse, json, sys, tempfile, time, traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

def family_pipeline(family: str, d: Path, texts, rows: Path, bf16: bool, device: str) -> dict:
    from latent_rl.fixtures import build_fixture
    from latent_rl.train import main
    prec = ["--precision", "bf16"] if bf16 else []
    data = ["--train", str(rows)]
    base = build_fixture(family, d / "base", texts)
    t0 = time.time()
    main(["sft", "--recipe", "none", "--model", str(base), *data, "--val", "", "--steps", "150", "--batch_size", "8",
          "--lr", "3e-3", "--warmup", "5", "--save_every", "0", "--log_every", "50", "--out", str(d / "sft"), *prec])
    main(["codi", "--recipe", "cpu-smoke", "--model", str(d / "sft" / "final"), *data, "--val", "", "--out",
          str(d / "codi"), *prec])
    main(["gkd", "--recipe", "cpu-smoke", "--model", str(d / "codi" / "final"), "--teacher", str(d / "sft" / "final"),
          *data, "--out", str(d / "gkd"), *prec])
    main(["grpo", "--recipe", "cpu-smoke", "--model", str(d / "gkd" / "final"), *data, "--out", str(d / "grpo"), *prec])
    main(["eval", "--model", f"text={d / 'sft' / 'final'}", "--model", f"latent={d / 'grpo' / 'final'}", "--rows",
                str(rows), "--max_new_tokens", "300", "--out", str(d / "eval"), "--device", device, "--dtype",
                "bf16" if bf16 else "fp32"])
    res = {k: [json.loads(l) for l in (d / "eval" / f"{k}.records.jsonl").read_text().splitlines()]
           for k in ("text", "latent")}
    return {"seconds": round(time.time() - t0, 1),
            **{f"{k}_accuracy": sum(r["correct"] for r in rs) / len(rs) for k, rs in res.items()},
            **{f"{k}_stopped": sum(r["generated"].endswith("<|end_of_text|>") for r in rs) / len(rs)
               for k, rs in res.items()}}

def main_(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--families", default="", help="comma-separated (default: every family)")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    from latent_rl.fixtures import FAMILIES, fixture_texts
    lines = (ROOT / "data" / "corpus" / "train.jsonl").read_text().splitlines()
    texts = fixture_texts([json.loads(l) for l in lines[:200]])
    out, tmp, failed = {}, Path(tempfile.mkdtemp(prefix="gpu_families_")), 0
    (tmp / "eight.jsonl").write_text("".join(l + "\n" for l in lines[:8]))
    for fam in [f for f in a.families.split(",") if f] or list(FAMILIES):
        try:
            out[fam] = family_pipeline(fam, tmp / fam, texts, tmp / "eight.jsonl", a.device != "cpu", a.device)
            if out[fam]["text_stopped"] < 0.75: raise RuntimeError(f"the SFT model stopped in {out[fam]['text_stopped']:.0%}")
            print(f"PASS {fam}: {out[fam]}", flush=True)
        except Exception as e:                       # one family's failure is reported; the others still run
            failed += 1
            out[fam] = {"error": f"{type(e).__name__}: {e}"}
            traceback.print_exc()
            print(f"FAIL {fam}: {out[fam]['error']}", flush=True)
    if a.json: Path(a.json).write_text(json.dumps(out, indent=1))
    return failed

if __name__ == "__main__":
    sys.exit(1 if main_() else 0)
