"""The values the DP model card's template is rendered with, from a ledger dict and a run folder's files: the
guarantee that holds for what is released (`_release_claim`), σ and sampling per phase, the unit of privacy, the
evaluation metrics that may be stated, the representation-law fits, library versions; every ε rounded up
(`format_epsilon`). `card.render_model_card` calls `template_values`.

Example:
    >>> format_epsilon(1.23441), format_epsilon(float("inf"))
    ('1.235', '∞')
"""

from __future__ import annotations

import math
from decimal import Decimal

from ..privacy.accountants import ACCOUNTANTS
from ..privacy.attack_rates import AttackTarget, attack_rates, attack_rates_from_epsilon
from ..privacy.units import ROW, describe_unit
from .public_names import is_private_metric

RANDOMNESS = {
    "os-entropy": "drawn from OS entropy (no seed reproduces them)",
    "seeded": "seeded with noise_seed: NOT private, anyone who knows the seed can remove the noise",
}
NEIGHBORING = {
    "add_remove": "add/remove one example for the plan's ε, which needs n secret; replace one example for the "
                  "guarantee above",
    "replace_one": "replace one example (n is public: this card states it)",
}
_VERSIONED = ("hf_dp_repr", "torch", "transformers", "opacus", "accelerate", "datasets", "peft", "huggingface_hub")


def template_values(led: dict, info: dict, scope: str, results: dict | None, laws: dict | None,
                    search: dict | None = None) -> dict:
    """The template's values for the ledger dict `led`, the caller's `info` (public text only), the trained scope,
    the run folder's metrics, law fits and search record (each None when absent)."""
    phases = led.get("phases") or [dict(name="train", noise_multiplier=led["noise_multiplier"],
                                        sample_rate=led["sample_rate"], steps=led["planned_steps"],
                                        expected_batch_size=led["expected_batch_size"])]
    private = all(p["noise_multiplier"] is not None and p["noise_multiplier"] > 0 for p in phases)
    eps = led.get("epsilon")
    n = led["dataset_size"]
    history = led.get("history", [])
    steps = led.get("steps_done", sum(int(t) for _, _, t in history))
    kind = "Poisson" if led.get("poisson_sampling", True) else "shuffled fixed-size"
    if len(phases) == 1:
        p = phases[0]
        sigma_text = _fmt(p["noise_multiplier"])
        sampling = (f"{kind} batches, sample rate q = {_fmt(p['sample_rate'])} "
                    f"(expected logical batch {p['expected_batch_size']})")
    else:
        sigma_text = "per phase, see the table below"
        sampling = f"{kind} batches, per phase (see the table below)"
    target, attack = led.get("target_epsilon"), led.get("target_attack_tpr_at_fpr")
    neighboring = led.get("neighboring", "add_remove")
    claim = _release_claim(led, history, neighboring, search) if private and eps is not None else None
    summary = (claim["summary"] if claim else
               "Not differentially private: a non-private reference run (noise_multiplier = 0).")
    if private and led.get("randomness") == "seeded":
        summary += (" **Not private as released:** the noise was seeded with `noise_seed`, and anyone who knows "
                    "the seed can remove it.")
    if private and led["target_delta"] >= 1 / n:
        summary += (f" **Weak δ:** δ = {led['target_delta']:g} is at least 1/n = 1/{n} for these n private "
                    f"{'examples' if led.get('privacy_unit', ROW) == ROW else 'units'}, so this guarantee allows "
                    "releasing a few of them outright; the run was allowed it explicitly (`allow_large_delta=True`).")
    name = info.get("model_name")
    headline = claim["epsilon"] if claim else eps
    if private:
        title = f"{name} (DP-SGD, ε = {format_epsilon(headline)})" if name else "DP fine-tuned model"
    else:
        title = f"{name}: non-private reference" if name else "Non-private reference model"
    last_batch = phases[-1]["expected_batch_size"]
    steps_per_epoch = max(1, n // last_batch)  # as DPTrainer's dataloader (and so the Trainer) counts an epoch
    randomness = led.get("randomness", "os-entropy")
    unit = led.get("privacy_unit", ROW)
    units_word = "examples" if unit == ROW else "units"
    return dict(
        model_name=title,
        summary=summary,
        private=private,
        epsilon_text=format_epsilon(headline) if headline is not None else "not computed",
        epsilon_label=claim["label"] if claim else "ε (spent, computed by the accountant)",
        epsilon_rows=claim["rows"] if claim else [],
        guarantee_note=claim["note"] if claim else "",
        delta=f"{led['target_delta']:g}",
        target_epsilon_text=(_fmt(target) if target is not None else "none (σ given)" if attack is None else
                             "none (σ calibrated for the target attack rate below)"),
        target_attack_text=None if attack is None else _attack_target_text(attack, neighboring),
        accountant=led["accountant"],
        accountant_text=_accountant_text(led["accountant"]),
        sigma_text=sigma_text,
        clip_norm=_fmt(led["per_sample_max_grad_norm"]),
        adaptive_text=_adaptive_text(led),
        clipping=led["clipping"],
        sampling_text=sampling,
        poisson_sampling=led.get("poisson_sampling", True),
        steps_done=steps,
        planned_steps=led.get("planned_steps", "?"),
        passes_text=_fmt(float(sum(q * t for _, q, t in history))),  # Σ q·t = expected examples seen / n
        trainer_epochs_text=_fmt(steps / steps_per_epoch),
        steps_per_epoch=steps_per_epoch,
        last_batch=last_batch,
        randomness_text=RANDOMNESS.get(randomness, randomness),
        neighboring_text=NEIGHBORING.get(neighboring, neighboring).replace(
            "one example", "one unit" if unit != ROW else "one example"),
        dataset_size=n,
        world_size=led.get("world_size", 1),
        phases=[{k: _fmt(v) if isinstance(v, float) else v for k, v in p.items()} for p in phases]
        if len(phases) > 1 else [],
        private_data=info.get("private_data") or f"the training set given to DPTrainer ({n} {units_word})",
        unit_text=describe_unit(unit),
        training_example=info.get("training_example"),  # e.g. "one conversation" (TRL trainers set these two)
        loss_tokens=info.get("loss_tokens"),
        units_word=units_word,
        unit_level="example-level" if unit == ROW else f"{unit}-level",
        public_data=info.get("public_data") or "none stated (pre-trained base weights, if any, are public)",
        base_model_text=info.get("base_model_description") or info.get("base_model") or "not recorded",
        scope=scope,
        metrics=[(k, _fmt(v)) for k, v in sorted((results or {}).items()) if _reported_metric(k, v)],
        laws=_law_rows(laws),
        analysis_data=info.get("analysis_data") or "the evaluation set",
        versions=_versions(),
        has_results=results is not None,
        has_laws=laws is not None,
    )


def _adaptive_text(led: dict) -> str | None:
    """Adaptive clipping's row: C's start, end and target quantile, and how the count shares σ (None without it)."""
    spec = led.get("adaptive_clipping")
    if not spec:
        return None
    norms = led.get("clip_norms") or [led["per_sample_max_grad_norm"]]
    sigma_eff = ", ".join(_fmt(s) for s in led.get("gradient_noise_multipliers", []))
    per = "example" if led.get("privacy_unit", ROW) == ROW else "unit"
    return (f"C from {_fmt(led['per_sample_max_grad_norm'])} (initial) to {_fmt(norms[-1])} (final), following the "
            f"{_fmt(spec['quantile'])} quantile of the per-{per} "
            f"gradient norms (learning rate {_fmt(spec['learning_rate'])}) from a noisy count (σ_b = "
            f"{_fmt(spec['count_noise'])}); the gradient's noise multiplier σ_eff = {sigma_eff}, with "
            "σ⁻² = σ_eff⁻² + (2σ_b)⁻² for the σ above, the one accounted")


def _release_claim(led: dict, history: list, neighboring: str, search: dict | None) -> dict:
    """The guarantee of what is released beside the model, which states n: ε for replace-one neighbours (the
    plan's ε, or for an add/remove plan its replace-one ε by dp_accounting's PLD), or the whole search's ε when a
    private hyperparameter search selected the model. Returns the headline ε, its label, the other ε rows, the
    summary line and a note for the paragraph under the table."""
    fmt, delta = format_epsilon, f"{led['target_delta']:g}"
    run, notes, rows = led["epsilon"], [], []
    if neighboring != "replace_one":
        from ..privacy.accounting import compute_epsilon

        run = compute_epsilon([tuple(h) for h in history], led["target_delta"], "pld", "replace_one")
        notes.append("The replace-one ε is dp_accounting's privacy loss distribution (pld) on the same history.")
    if search:
        headline, label = search["epsilon_replace_one"], "ε of the whole hyperparameter search (the guarantee)"
        rows.append(("ε of the selected trial's run alone (not the guarantee)", fmt(run)))
        summary = (f"(ε = {fmt(headline)}, δ = {delta})-differentially private, for replace-one neighbours: the "
                   "whole hyperparameter search on the private data that selected this model (Papernot & Steinke "
                   f"2022; {search['trial_count']}, a secret number of trials). The tables below describe the "
                   f"selected trial's own run, whose ε alone ({fmt(run)}) is not the guarantee.")
        notes.append("The whole search's ε is the Papernot-Steinke bound over every schedule the search could draw "
                     "(`hf_dp_repr.tuning.selection_privacy`).")
    else:
        headline, label = run, ("ε (spent, computed by the accountant)" if neighboring == "replace_one"
                                else "ε for replace-one neighbours (the guarantee)")
        summary = (f"(ε = {fmt(run)}, δ = {delta})-differentially private, for replace-one neighbours (n is "
                   "public: this card states it).")
    if recomputed := led.get("recomputed_steps"):
        redone = sum(b - a + 1 for a, b in recomputed)
        target = led.get("target_epsilon")
        notes.append(f"ε is above {'the target ε = ' + fmt(target) if target is not None else 'the plan'}"
                     f" because the run was interrupted and resumed: {redone} noisy step(s) computed after its last "
                     f"checkpoint (steps {', '.join(f'{a}-{b}' for a, b in recomputed)}) were lost and computed "
                     "again with fresh noise, and every noisy step computed is charged.")
    if neighboring != "replace_one":
        plan_eps = search["epsilon"] if search else led["epsilon"]
        rows.append(("ε for add/remove neighbours (the plan's; needs n secret)", fmt(plan_eps)))
        summary += (f" The run was planned for add/remove neighbours, ε = {fmt(plan_eps)}; that holds only while n "
                    "and what reveals it (sample rate, steps, epochs) stay secret, and this card states them.")
    if search:  # a search's guarantee is an (ε, δ) pair (Papernot-Steinke), not a privacy loss distribution
        rates = attack_rates_from_epsilon(headline, led["target_delta"], "replace_one")
    else:
        rates = attack_rates([tuple(h) for h in history], "replace_one")
    rows += attack_rows(rates)
    summary += f" For an attacker, {rates.describe()}."
    return dict(epsilon=headline, label=label, rows=rows, summary=summary, note=" ".join(notes))


def attack_rows(rates) -> list[tuple[str, str]]:
    """The guarantee table's rows of what a membership attacker can reach (`privacy.attack_rates`)."""
    fprs = " / ".join(f"{100 * f:g} %" for f in rates.tpr_at_fpr)
    source = "from the run's privacy loss distribution" if rates.source != "(ε, δ)" else "from (ε, δ) alone"
    return [(f"largest TPR of any membership test at FPR {fprs} ({source})",
             " / ".join(f"{100 * t:.3g} %" for t in rates.tpr_at_fpr.values())),
            ("largest attacker advantage (TPR − FPR)", f"{100 * rates.advantage:.3g} %")]


def _attack_target_text(target: str, neighboring: str) -> str:
    """The attack-rate target σ was calibrated for (`target_attack_tpr_at_fpr`), for the plan's relation."""
    relation = ("replace-one neighbours" if neighboring == "replace_one" else
                "add/remove neighbours (the plan's; the replace-one rates above are higher)")
    return f"{AttackTarget.parse(target).describe()}, for {relation} (`target_attack_tpr_at_fpr={target}`)"


def audit_row(audit: dict | None) -> dict | None:
    """The one-run canary audit (`canary_audit.json`, written only when the user asks) as template values."""
    if not audit:
        return None
    return dict(bound=_fmt(float(audit["epsilon_lower_bound"])), confidence=f"{100 * audit['confidence']:g}",
                canaries=audit["canaries"], guesses=audit["guesses"], correct=audit["correct"],
                delta=f"{audit['delta']:g}")


def exposure_rows(report: dict | None) -> dict | None:
    """The DP model's canary exposures (`canary_exposure.json`, written by `hf-dp-repr audit exposure`)."""
    if not report:
        return None
    rows = [dict(repeats=c["repeats"] or "never", candidates=c["candidates"], exposure=f"{c['exposure']:.2f}",
                 method=c["method"], covered_by=c["covered_by"]) for c in report["canaries"]]
    return dict(rows=rows, random_level=f"{report['random_level']:.2f}", warning=report["warning"],
                format=report.get("format", "the secret code of NAME is 4 7 1 9"))


def _reported_metric(key: str, value) -> bool:
    """Held-out metrics and ε; not timings, and not the training loss (computed on private data outside DP)."""
    if not isinstance(value, (int, float)) or key.endswith(("_runtime", "_per_second")) or is_private_metric(key):
        return False
    return key.startswith(("eval_", "test_")) or key in ("epsilon", "perplexity", "accuracy")


def _law_rows(laws: dict | None) -> list[dict]:
    rows = []
    for entry in (laws or {}).get("analyses", []):
        label = f"step {entry.get('step')} ({entry.get('event', '?')})"
        for law_name, key in (("separation fuzziness D_l", "fuzziness_law"), ("prediction residual PR_l",
                                                                              "residual_law")):
            fit = entry.get(key)
            if fit:
                layers = fit.get("layers") or []
                ok = fit.get("reliable", True)  # False: meaningless by the analyzer's own check, not published
                rows.append(dict(label=label, law=law_name, rho=_fmt(fit["rho"]) if ok else "withheld: too few rows",
                                 r=_fmt(fit.get("r")) if ok else "n/a",
                                 layers=f"{layers[0]}..{layers[-1]}" if layers else "?"))
    return rows


def _versions() -> list[tuple[str, str]]:
    from importlib.metadata import PackageNotFoundError, version

    out = []
    for name in _VERSIONED:
        try:
            out.append((name.replace("_", "-") if name == "hf_dp_repr" else name, version(name.replace("_", "-"))))
        except PackageNotFoundError:
            continue
    return out


def _accountant_text(name: str) -> str:
    """'pld (dp_accounting)': the accountant and who computes it (from the registry, where it is registered)."""
    return f"{name} ({ACCOUNTANTS[name].source})" if name in ACCOUNTANTS else name


def format_epsilon(v) -> str:
    """ε to 4 significant digits, rounded up: a stated ε is never below the accountant's."""
    text = _fmt(v)
    if isinstance(v, float) and math.isfinite(v) and float(text) < v:
        last = Decimal(text).as_tuple().exponent  # the place of the last digit shown
        text = _fmt(float(Decimal(text) + Decimal(1).scaleb(last)))
    return text


def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        if math.isinf(v):
            return "∞"
        return f"{v:.4g}"
    return str(v)
