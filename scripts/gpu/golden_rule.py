#!/usr/bin/env python3
"""Judge greedy generations by the golden rule: GPU against CPU, or ember against llama.cpp.

Inputs are `ember run --format json` outputs: one JSON object with "prompt_ids", "tokens" and
"steps", where steps[i] = {"id": chosen id, "top": [[id, logprob], [id, logprob]]} holds the two
most likely ids of step i with their log-probabilities (natural log) before sampling. The golden
file tests/data/golden/greedy.jsonl has the same fields per (model, prompt) line.

Sub-commands (each prints one verdict line per case, "PASS ..." or "FAIL ...", then a summary,
and exits 1 if any case failed, 2 on unusable input):

golden  ember against llama.cpp (tests/data/golden/README.md):
    The prompt ids must be equal. The candidate's greedy ids must equal the golden `tokens` up
    to the first step k where they part (nothing after k is compared), and at k one of:
      (a) llama.cpp disagrees with itself: steps[k].id != tokens[k];
      (b) the candidate chose steps[k].id;
      (c) the golden top two probabilities are within 2% of each other:
          p2 >= 0.98 * p1, i.e. logprob1 - logprob2 <= -ln(0.98) = 0.0202.
    A candidate with fewer tokens than the golden line, all equal, fails (it was run with a
    smaller -n, or stopped on a token the golden run did not stop on).

ember   a candidate (GPU) against a reference (CPU) ember run of the same prompt, by the same
    rule as `golden`, the reference playing llama.cpp's part:
    The prompt ids must be equal. The greedy ids must be equal up to the first step k where
    they part, and at k one of:
      (a) the reference disagrees with itself: re-evaluated at step k alone (its prompt plus
          its tokens[:k] in one batch, one new token; `--reeval-ember`, run on the reference's
          device), it chooses an id other than its tokens[k];
      (b) the candidate chose that re-evaluated id;
      (c) the reference's top two at k are within 2% in probability: lp1 - lp2 <= -ln(0.98).
    Without --reeval-ember (or a model column in the case list) (a) and (b) cannot be checked
    and only (c) can pass a parting. In addition, over the steps before k (where both saw the
    same context) the log-probability each assigns to the chosen token must agree within
    MAX_LOGPROB_DIFF (default 0.5 nats; --max-logprob-diff, 0 disables): greedy ids can agree
    while the distributions are wrong (a missing scale, a wrong softcap), and this catches it.
    Runs of different lengths whose tokens all agree fail: with equal tokens both stop on the
    same end-of-generation token, so they were run with different -n.

ppl     perplexity of a candidate against a reference: `ember perplexity` outputs (the line
        "Final estimate: PPL = X +/- Y"); passes when |cand - ref| / ref <= TOLERANCE (default
        0.01; --tolerance).

selftest  runs built-in cases of every rule, passing and failing ones, and checks each verdict.
"""

import argparse
import json
import math
import os
import re
import sys

WITHIN_2_PERCENT = -math.log(0.98)


class BadInput(Exception):
    pass


def load_ember_json(path):
    """The last line of `path` that parses as a JSON object (ember prints one)."""
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e}")
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                continue
            for key in ("prompt_ids", "tokens"):
                if key not in obj:
                    raise BadInput(f"{path}: expected key {key!r} in the JSON object, found keys {sorted(obj)}")
            return obj
    raise BadInput(f"{path}: expected a JSON object line from `ember run --format json`, found none")


def top2(step):
    """[(id, logprob), (id, logprob)] of a step, or None when the step has fewer than two."""
    top = step.get("top") or []
    if len(top) < 2:
        return None
    return [(int(t[0]), float(t[1])) for t in top[:2]]


def first_parting(a, b):
    n = min(len(a), len(b))
    for k in range(n):
        if a[k] != b[k]:
            return k
    return None


def judge_golden(golden, cand):
    """(passed, reason) for a candidate ember output against one golden line."""
    if list(golden["prompt_ids"]) != list(cand["prompt_ids"]):
        return False, f"prompt ids differ: golden {golden['prompt_ids']} vs {cand['prompt_ids']}"
    ref, got = golden["tokens"], cand["tokens"]
    k = first_parting(ref, got)
    if k is None:
        if len(got) < len(ref):
            return False, f"candidate has {len(got)} tokens, all equal, expected {len(ref)} (run with -n {len(ref)})"
        return True, f"identical {len(ref)}/{len(ref)} tokens"
    step = golden["steps"][k]
    where = f"parts at step {k} (golden {ref[k]}, candidate {got[k]})"
    if step["id"] != ref[k]:
        return True, f"{where}: llama.cpp disagrees with itself there (re-evaluated {step['id']})"
    if got[k] == step["id"]:
        return True, f"{where}: candidate chose llama.cpp's re-evaluated choice"
    t = top2(step)
    if t is not None and t[0][1] - t[1][1] <= WITHIN_2_PERCENT:
        return True, f"{where}: golden top two within 2% ({t[0][1]:.4f} vs {t[1][1]:.4f})"
    detail = f"golden top two {t}" if t else "golden step has no top two"
    return False, f"{where}: not a near tie ({detail})"


def chosen_logprob(step):
    for tid, lp in step.get("top") or []:
        if int(tid) == int(step["id"]):
            return float(lp)
    return None


def ember_reevaluator(ember, device):
    """A function (model, ids) -> the greedy id a reference ember chooses for the prompt `ids`
    evaluated in one batch on `device`."""
    return lambda model, ids: reevaluate(ember, device, model, ids)


def reevaluate(ember, device, model, ids):
    import subprocess

    cmd = [ember, "run", "-m", model, "--device", device, "--prompt-ids", ",".join(str(i) for i in ids),
           "-n", "1", "--temp", "0", "--format", "json"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise BadInput(f"re-evaluation failed ({' '.join(cmd[:6])} ...): {done.stderr.strip()[-300:]}")
    for line in reversed(done.stdout.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            out = json.loads(line)
            if out.get("tokens"):
                return int(out["tokens"][0])
    raise BadInput(f"re-evaluation printed no generated token: {done.stdout[-300:]!r}")


def judge_ember(ref, cand, max_logprob_diff, reeval=None, model=None):
    """(passed, reason) for a candidate ember output against a reference ember output."""
    if list(ref["prompt_ids"]) != list(cand["prompt_ids"]):
        return False, f"prompt ids differ: reference {ref['prompt_ids']} vs candidate {cand['prompt_ids']}"
    rt, ct = ref["tokens"], cand["tokens"]
    rs, cs = ref.get("steps") or [], cand.get("steps") or []
    k = first_parting(rt, ct)
    common = k if k is not None else min(len(rt), len(ct))
    drift = 0.0
    if max_logprob_diff > 0:
        if len(rs) < common or len(cs) < common:
            return False, f"expected per-step log-probabilities (\"steps\") for {common} steps, found {len(rs)} and {len(cs)}"
        for i in range(common):
            a, b = chosen_logprob(rs[i]), chosen_logprob(cs[i])
            if a is None or b is None:
                continue
            if abs(a - b) > drift:
                drift = abs(a - b)
            if abs(a - b) > max_logprob_diff:
                return False, f"step {i}: log-prob of token {rt[i]} is {a:.4f} on the reference, {b:.4f} on the candidate: differ by more than {max_logprob_diff}"
    drift_note = f"max |dlogprob| {drift:.4f}"
    if k is None:
        if len(rt) == len(ct):
            return True, f"identical {len(rt)}/{len(rt)} tokens, {drift_note}"
        return False, f"lengths differ with equal tokens: reference {len(rt)}, candidate {len(ct)} (one run stopped where the other did not)"
    if k >= len(rs):
        return False, f"parts at step {k}: reference has no step {k} log-probabilities"
    t = top2(rs[k])
    where = f"parts at step {k} (reference {rt[k]}, candidate {ct[k]})"
    if t is None:
        return False, f"{where}: reference step has no top two"
    (r1, lp1), (r2, lp2) = t
    margin = lp1 - lp2
    if margin <= WITHIN_2_PERCENT:
        return True, f"{where}: reference top two within 2% (margin {margin:.4f}), {drift_note}"
    if reeval is None or not model:
        return False, f"{where}: reference margin {margin:.4f} is not within 2% and no re-evaluation was possible"
    again = reeval(model, list(ref["prompt_ids"]) + list(rt[:k]))
    if again != rt[k]:
        return True, f"{where}: the reference disagrees with itself (re-evaluated: {again}), margin {margin:.4f}, {drift_note}"
    if ct[k] == again:
        return True, f"{where}: candidate chose the reference's re-evaluated id {again}, {drift_note}"
    return False, f"{where}: reference margin {margin:.4f} > 2% and its re-evaluation agrees with itself ({again}): not a near tie"


PPL_LINE = re.compile(r"Final estimate: PPL = ([0-9.eE+-]+|nan|inf)")


def load_ppl(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError as e:
        raise BadInput(f"cannot read {path}: {e}")
    m = PPL_LINE.findall(text)
    if not m:
        raise BadInput(f"{path}: expected a line 'Final estimate: PPL = X', found none")
    return float(m[-1])


def judge_ppl(ref, cand, tolerance):
    if not (math.isfinite(ref) and math.isfinite(cand)) or ref <= 0:
        return False, f"PPL reference {ref}, candidate {cand}: expected finite positive values"
    rel = abs(cand - ref) / ref
    verdict = rel <= tolerance
    return verdict, f"PPL reference {ref:.4f}, candidate {cand:.4f}: relative difference {rel:.4%} {'<=' if verdict else '>'} {tolerance:.2%}"


def report(results):
    failed = 0
    for label, (ok, reason) in results:
        print(f"{'PASS' if ok else 'FAIL'} {label}: {reason}")
        failed += 0 if ok else 1
    print(f"golden_rule: {len(results) - failed}/{len(results)} passed")
    return 1 if failed else 0


def cmd_golden(args):
    lines = []
    with open(args.golden, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                obj = json.loads(line)
                if obj["model"] == args.model:
                    lines.append(obj)
    if not lines:
        raise BadInput(f"{args.golden}: expected lines of model {args.model!r}, found none")
    by_id = {g["id"]: g for g in lines}
    cases = []
    if args.case:
        for case_id, path in args.case:
            if case_id not in by_id:
                raise BadInput(f"golden case {case_id!r}: expected one of {sorted(by_id)}")
            cases.append((case_id, path))
    else:
        if not args.dir:
            raise BadInput("golden: expected --case ID FILE or --dir DIR")
        cases = [(g["id"], os.path.join(args.dir, g["id"] + ".json")) for g in lines]
    results = []
    for case_id, path in cases:
        label = f"{args.model}/{case_id}"
        try:
            results.append((label, judge_golden(by_id[case_id], load_ember_json(path))))
        except BadInput as e:
            results.append((label, (False, str(e))))
    return report(results)


def read_case_list(path):
    cases = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.startswith("#"):
                continue
            parts = line.rstrip("\n").split("\t")
            if len(parts) not in (3, 4):
                raise BadInput(f"{path}:{n}: expected LABEL<TAB>REFERENCE<TAB>CANDIDATE[<TAB>MODEL], found {line!r}")
            cases.append(parts)
    return cases


def cmd_ember(args):
    cases = list(args.case or [])
    if args.list:
        cases += read_case_list(args.list)
    if not cases:
        raise BadInput("ember: expected --case LABEL REF CAND or --list FILE")
    results = []
    reeval = ember_reevaluator(args.reeval_ember, args.reeval_device) if args.reeval_ember else None
    for case in cases:
        label, ref_path, cand_path = case[:3]
        model = case[3] if len(case) > 3 else None
        try:
            ref, cand = load_ember_json(ref_path), load_ember_json(cand_path)
            results.append((label, judge_ember(ref, cand, args.max_logprob_diff, reeval, model)))
        except BadInput as e:
            results.append((label, (False, str(e))))
    return report(results)


def cmd_ppl(args):
    cases = list(args.case or [])
    if args.list:
        cases += read_case_list(args.list)
    if not cases:
        raise BadInput("ppl: expected --case LABEL REF CAND or --list FILE")
    results = []
    for label, ref_path, cand_path in cases:
        try:
            results.append((label, judge_ppl(load_ppl(ref_path), load_ppl(cand_path), args.tolerance)))
        except BadInput as e:
            results.append((label, (False, str(e))))
    return report(results)


def _step(i, lp1, j, lp2, chosen=None):
    return {"id": i if chosen is None else chosen, "top": [[i, lp1], [j, lp2]]}


def cmd_selftest(_args):
    """Each rule on cases with a known verdict; exits 1 when a verdict is not the expected one."""
    same = [_step(5, -0.5, 6, -2.0), _step(7, -0.2, 8, -3.0), _step(9, -1.0, 10, -1.05)]
    ref = {"prompt_ids": [1, 2], "tokens": [5, 7, 9], "steps": same}

    def cand(tokens, steps=None, prompt=(1, 2)):
        return {"prompt_ids": list(prompt), "tokens": tokens, "steps": steps if steps is not None else same}

    d = 0.5
    stable = lambda _model, ids: {2: 5, 3: 7, 4: 9}[len(ids)]  # the reference re-evaluates to its own tokens
    unstable = lambda _model, ids: {2: 5, 3: 7, 4: 10}[len(ids)]  # at step 2 it would choose 10
    checks = [
        ("ember identical", judge_ember(ref, cand([5, 7, 9]), d), True),
        ("ember parting, reference stable", judge_ember(ref, cand([5, 7, 10]), d, stable, "m"), False),
        ("ember parting, candidate chose the re-evaluated id", judge_ember(ref, cand([5, 7, 10]), d, unstable, "m"), True),
        ("ember parting, reference unstable", judge_ember(ref, cand([5, 7, 11]), d, unstable, "m"), True),
        ("ember parting, no re-evaluation", judge_ember(ref, cand([5, 7, 10]), d), False),
        ("ember clear choice missed", judge_ember(ref, cand([5, 8, 9]), d, stable, "m"), False),
        ("ember prompt differs", judge_ember(ref, cand([5, 7, 9], prompt=(1, 3)), d), False),
        ("ember shorter", judge_ember(ref, cand([5, 7]), d), False),
        ("ember log-prob drift", judge_ember(ref, cand([5, 7, 9], [_step(5, -1.5, 6, -2.0)] + same[1:]), d), False),
        ("ember drift check off", judge_ember(ref, cand([5, 7, 9], [_step(5, -1.5, 6, -2.0)] + same[1:]), 0), True),
        ("ember within 2%", judge_ember({**ref, "steps": same[:2] + [_step(9, -1.0, 10, -1.01)]}, cand([5, 7, 10]), d), True),
    ]
    golden = {"prompt_ids": [1], "tokens": [5, 7, 9], "steps": [_step(5, -0.5, 6, -2.0), _step(7, -0.3, 8, -3.0, chosen=8), _step(9, -1.0, 10, -1.01)]}
    checks += [
        ("golden identical", judge_golden(golden, {"prompt_ids": [1], "tokens": [5, 7, 9]}), True),
        ("golden llama.cpp unstable", judge_golden(golden, {"prompt_ids": [1], "tokens": [5, 4, 9]}), True),
        ("golden near tie", judge_golden(golden, {"prompt_ids": [1], "tokens": [5, 7, 10]}), True),
        ("golden clear choice missed", judge_golden(golden, {"prompt_ids": [1], "tokens": [6, 7, 9]}), False),
        ("golden too short", judge_golden(golden, {"prompt_ids": [1], "tokens": [5, 7]}), False),
        ("ppl within 1%", judge_ppl(10.0, 10.05, 0.01), True),
        ("ppl off by 2%", judge_ppl(10.0, 10.2, 0.01), False),
        ("ppl nan", judge_ppl(10.0, float("nan"), 0.01), False),
    ]
    wrong = 0
    for label, (ok, reason), expected in checks:
        good = ok == expected
        wrong += 0 if good else 1
        print(f"{'ok  ' if good else 'BAD '} {label}: {'PASS' if ok else 'FAIL'} ({reason})")
    print(f"selftest: {len(checks) - wrong}/{len(checks)} verdicts as expected")
    return 1 if wrong else 0


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("golden", help="ember outputs against tests/data/golden/greedy.jsonl")
    g.add_argument("--golden", required=True)
    g.add_argument("--model", required=True, help="the golden file's model name")
    g.add_argument("--case", nargs=2, action="append", metavar=("ID", "FILE"))
    g.add_argument("--dir", help="folder of <id>.json candidate outputs, one per golden line of the model")
    e = sub.add_parser("ember", help="candidate (GPU) against reference (CPU) ember outputs")
    e.add_argument("--case", nargs=3, action="append", metavar=("LABEL", "REF", "CAND"))
    e.add_argument("--list", help="file of LABEL<TAB>REF<TAB>CAND lines")
    e.add_argument("--reeval-ember", help="ember binary to re-evaluate the reference at a parting step")
    e.add_argument("--reeval-device", default="cpu", help="the reference's --device [cpu]")
    e.add_argument("--max-logprob-diff", type=float, default=0.5)
    q = sub.add_parser("ppl", help="perplexity outputs, candidate against reference")
    q.add_argument("--case", nargs=3, action="append", metavar=("LABEL", "REF", "CAND"))
    q.add_argument("--list", help="file of LABEL<TAB>REF<TAB>CAND lines")
    q.add_argument("--tolerance", type=float, default=0.01)
    sub.add_parser("selftest", help="check every rule on built-in cases")
    args = p.parse_args()
    try:
        return {"golden": cmd_golden, "ember": cmd_ember, "ppl": cmd_ppl, "selftest": cmd_selftest}[args.command](args)
    except BadInput as err:
        print(f"golden_rule: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
