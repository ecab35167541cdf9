"""The registries (accountants, ghost-norm rules, clippers ...): one registration adds an entry that every user of it
sees, read when used; a name registered twice is refused unless replaced on purpose."""

import copy
import json

import pytest
import torch
from torch import nn

from hf_dp_repr import DPTrainer, DPTrainingArguments
from hf_dp_repr.cli import main
from hf_dp_repr.errors import DPConfigError
from hf_dp_repr.privacy.accountants import ACCOUNTANTS, register_accountant
from hf_dp_repr.privacy.accounting import calibrate_noise_multiplier, compute_epsilon, too_low_message
from hf_dp_repr.privacy.clippers import CLIPPERS, HooksClipper, register_clipper
from hf_dp_repr.privacy.ghost_clipping import GhostClippingEngine, unsupported_reason
from hf_dp_repr.privacy.ghost_rules import GHOST_RULES, register_ghost_rule, rows
from hf_dp_repr.tiny import tiny_vit

pytestmark = pytest.mark.usefixtures("one_thread")
FINE_ORDERS = [1 + x / 100 for x in range(1, 1000)] + list(range(11, 257))


@pytest.fixture
def registries():
    """Registrations last for the process: each test gets the registries back as they were."""
    from hf_dp_repr.privacy.clipping_modes import CLIPPING_MODES
    from hf_dp_repr.scope.groups import GROUPS
    from hf_dp_repr.training.hp_search.backends import SEARCH_BACKENDS

    saved = [(table, dict(table)) for table in (ACCOUNTANTS, GHOST_RULES, CLIPPERS, CLIPPING_MODES, GROUPS,
                                                SEARCH_BACKENDS)]
    yield
    for table, entries in saved:
        table.clear()
        table.update(entries)


def opacus_rdp(history, delta, orders):
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    acc.history = list(history)
    return acc.get_epsilon(delta, alphas=orders)


@pytest.mark.filterwarnings("ignore:Optimal order is the largest alpha")  # rdp_fine's floor, at σ = 1e6
def test_a_registered_accountant_is_used_everywhere(registries, tmp_path, capsys):
    from transformers import HfArgumentParser

    register_accountant("rdp_fine", source="Opacus")(lambda h, delta, rel: opacus_rdp(h, delta, FINE_ORDERS))
    history = [(1.0, 0.01, 1000)]
    eps = compute_epsilon(history, 1e-5, "rdp_fine")
    assert eps == opacus_rdp(history, 1e-5, FINE_ORDERS) < compute_epsilon(history, 1e-5, "rdp")
    sigma = calibrate_noise_multiplier(2.0, 1e-5, 0.01, 1000, "rdp_fine")
    assert 0.999 * 2.0 <= compute_epsilon([(sigma, 0.01, 1000)], 1e-5, "rdp_fine") <= 2.0
    # the arguments (choices of the command line too), their defaults and refusals, the CLI, the messages
    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, accountant="rdp_fine", report_to="none")
    assert args.neighboring == "add_remove"
    parsed, = HfArgumentParser(DPTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--target_epsilon", "1", "--accountant", "rdp_fine", "--report_to", "none"])
    assert parsed.accountant == "rdp_fine"
    with pytest.raises(DPConfigError, match=r"needs accountant='pld' \(dp_accounting\); the 'rdp_fine' accountant"):
        DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, accountant="rdp_fine",
                            neighboring="replace_one", report_to="none")
    assert main(["privacy", "--sample-rate", "0.01", "--noise-multiplier", "1.0", "--steps", "1000", "--delta", "1e-5",
                 "--accountant", "rdp_fine"]) == 0
    assert json.loads(capsys.readouterr().out)["epsilon"] == eps
    with pytest.raises(ValueError, match=r"use one of \('prv', 'rdp', 'pld', 'rdp_fine'\)"):
        compute_epsilon(history, 1e-5, "rdp_finer")
    assert "accountant='rdp_fine' certifies it" in too_low_message(0.05, 1e-5, 0.01, 100, "prv")


def test_a_registered_replace_one_accountant_is_the_default_for_it(registries, tmp_path, capsys):
    @register_accountant("pld_fine", neighboring=("add_remove", "replace_one"), source="dp_accounting")
    def pld_fine(history, delta, neighboring):
        import dp_accounting
        from dp_accounting.pld.pld_privacy_accountant import PLDAccountant

        relation = dp_accounting.NeighboringRelation
        acc = PLDAccountant(relation.REPLACE_ONE if neighboring == "replace_one" else relation.ADD_OR_REMOVE_ONE)
        for sigma, q, steps in history:
            acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
        return acc.get_epsilon(delta)

    args = DPTrainingArguments(output_dir=str(tmp_path), target_epsilon=1.0, accountant="pld_fine", report_to="none")
    assert args.neighboring == "replace_one"
    history = [(1.0, 0.127, 210)]  # a finer grid: at most the default 'pld' (a coarser pessimistic rounding)
    fine = compute_epsilon(history, 5e-5, "pld_fine", "replace_one")
    assert fine <= compute_epsilon(history, 5e-5, "pld", "replace_one") <= fine * 1.002
    assert main(["privacy", "--sample-rate", "0.127", "--noise-multiplier", "1.0", "--steps", "210", "--delta",
                 "5e-5", "--accountant", "pld_fine"]) == 0
    assert json.loads(capsys.readouterr().out)["neighboring"] == "replace_one"
    with pytest.raises(SystemExit, match="needs --accountant pld or pld_fine"):
        main(["privacy", "--sample-rate", "0.1", "--noise-multiplier", "1.0", "--steps", "10", "--delta", "1e-5",
              "--accountant", "prv", "--neighboring", "replace_one"])


def test_an_accountant_that_under_reports_is_refused_at_registration(registries):
    from opacus.accountants import GaussianAccountant

    def central_limit(history, delta, neighboring):  # Opacus' gdp under another name
        acc = GaussianAccountant()
        acc.history = list(history)
        return acc.get_epsilon(delta)

    with pytest.warns(UserWarning, match="GDP accounting is experimental"), pytest.raises(
            DPConfigError, match=r"register_accountant\('clt'\): ε = 0.47.* below 1.6.*not an upper bound, refused"):
        register_accountant("clt")(central_limit)
    with pytest.raises(DPConfigError, match="'gdp' accountant is refused"):
        register_accountant("gdp")(lambda h, delta, rel: 100.0)
    with pytest.raises(DPConfigError, match="neighboring=\\('add_one',\\)"):
        register_accountant("big", neighboring=("add_one",))(lambda h, delta, rel: 100.0)
    halved = register_accountant("half_pld", neighboring=("replace_one",))  # right for add/remove, not for this
    with pytest.raises(DPConfigError, match="replace_one neighbours, is below"):
        halved(lambda h, delta, rel: ACCOUNTANTS["pld"].epsilon(h, delta, "add_remove"))
    assert not {"clt", "gdp", "big", "half_pld"} & set(ACCOUNTANTS)


class Gain(nn.Module):
    """y = x ⊙ s + b: a module type with trained tensors that no built-in rule knows."""

    def __init__(self, d):
        super().__init__()
        self.s, self.b = nn.Parameter(torch.linspace(0.5, 1.5, d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x * self.s + self.b


def register_gain(**kw):
    @register_ghost_rule(Gain, **kw)
    def gain_pieces(module, inputs, grad, trained):
        g = rows(grad)
        return [(module.s, "explicit", (g * rows(inputs[0])).sum(1)), (module.b, "explicit", g.sum(1))]


def test_a_registered_rule_gives_the_norms_and_sums_of_brute_force(registries):
    model = nn.Sequential(nn.Linear(4, 6), Gain(6), nn.Tanh(), nn.Linear(6, 3)).double()
    assert unsupported_reason(model) == "1 (Gain) has trained parameters and no per-example rule"
    register_gain(unsupported=lambda m: "has a negative gain" if (m.s < 0).any() else None)
    assert unsupported_reason(model) is None
    x = torch.randn(5, 7, 4, dtype=torch.float64)
    params = list(model.parameters())
    per_example = [torch.autograd.grad(model(x[i]).pow(2).sum(), params) for i in range(5)]
    engine = GhostClippingEngine(model)
    with engine.recording():
        model(x).pow(2).sum().backward()
    norms = engine.squared_norms()
    c = torch.linspace(0.2, 1.0, 5, dtype=torch.float64)
    sums = engine.clipped_sums({p: c for p in params})
    for j, p in enumerate(params):
        torch.testing.assert_close(norms[p], torch.stack([g[j].pow(2).sum() for g in per_example]))
        torch.testing.assert_close(sums[p], sum(c[i] * per_example[i][j] for i in range(5)))
    engine.remove()
    with torch.no_grad():
        model[1].s[0] = -1.0
    assert unsupported_reason(model) == "1 (Gain) has a negative gain"  # the rule's own refusal


def test_a_predicate_rule_and_a_subclass_that_changes_the_forward(registries):
    class Doubled(nn.Linear):  # its own forward: the built-in Linear rule must not claim it
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(Doubled(3, 2, bias=False)).double()
    assert "no per-example rule" in unsupported_reason(model)
    register_ghost_rule(lambda m: type(m) is Doubled)(
        lambda m, inputs, grad, trained: [(m.weight, "factors", 2 * rows(grad), rows(inputs[0]))])
    x = torch.randn(4, 9, 3, dtype=torch.float64)
    engine = GhostClippingEngine(model)
    with engine.recording():
        model(x).pow(2).sum().backward()
    brute = [torch.autograd.grad(model(x[i]).pow(2).sum(), model[0].weight)[0].pow(2).sum() for i in range(4)]
    torch.testing.assert_close(engine.squared_norms()[model[0].weight], torch.stack(brute))


def test_the_trainer_clips_a_registered_module_by_ghost_norms_else_by_hooks(registries, digits, tmp_path, caplog):
    from transformers.utils import logging

    def update(name):
        model = tiny_vit()
        model.classifier = nn.Sequential(model.classifier, Gain(10))
        start = copy.deepcopy(model.state_dict())
        args = DPTrainingArguments(output_dir=str(tmp_path / name), per_device_train_batch_size=8, max_steps=1,
                                   learning_rate=0.1, optim="sgd", report_to="none", save_strategy="no",
                                   disable_tqdm=True, noise_multiplier=0.0, noise_seed=1, per_sample_max_grad_norm=0.5)
        trainer = DPTrainer(model=model, args=args, train_dataset=digits["train"].select(range(16)))
        trainer.train()
        return trainer.clipping_engine, {k: model.state_dict()[k] - start[k] for k in start}

    logging.enable_propagation()
    with caplog.at_level("WARNING"):
        engine, hooks = update("hooks")
    assert engine == "hooks"
    assert "falls back to Opacus hooks (slower, more memory): classifier.1 (Gain) has trained parameters and no " \
           "per-example rule" in caplog.text
    register_gain()
    engine, ghost = update("ghost")
    assert engine == "ghost" and ghost["classifier.1.s"].abs().sum() > 0
    num = sum((ghost[k] - hooks[k]).double().pow(2).sum() for k in hooks)  # σ = 0 and the same (seeded) batch
    assert (num / sum(hooks[k].double().pow(2).sum() for k in hooks)).sqrt() <= 1e-5


def test_a_name_registered_twice_is_refused_unless_replaced(registries):
    from hf_dp_repr.privacy.clipping_modes import CLIPPING_MODES, register_clipping_mode
    from hf_dp_repr.scope.groups import GROUPS, register_group
    from hf_dp_repr.training.hp_search.backends import SEARCH_BACKENDS, register_search_backend

    pld = ACCOUNTANTS["pld"]
    with pytest.raises(DPConfigError, match="accountant 'pld' is already registered; pass replace=True"):
        register_accountant("pld", neighboring=("add_remove", "replace_one"))(pld.epsilon)
    assert ACCOUNTANTS["pld"] is pld
    register_accountant("pld", neighboring=("add_remove", "replace_one"), source="again", replace=True)(pld.epsilon)
    assert ACCOUNTANTS["pld"].source == "again" and list(ACCOUNTANTS)[-1] == "pld"  # replaced in place
    for register, table, name in [(register_clipper, CLIPPERS, "hooks"),
                                  (lambda n: register_clipping_mode(n), CLIPPING_MODES, "flat"),
                                  (lambda n: register_group(n), GROUPS, "head"),
                                  (lambda n: register_ghost_rule(n), GHOST_RULES, nn.Linear)]:
        before = table[name]
        with pytest.raises(ValueError, match="is already registered"):
            register(name)(lambda *a: None)
        assert table[name] is before
    with pytest.raises(ValueError, match="search backend 'optuna' is already registered"):
        register_search_backend("optuna", lambda *a, **k: None)
    assert SEARCH_BACKENDS["optuna"] is not None


def test_a_clipper_registered_after_the_arguments_are_imported_is_accepted(registries, tmp_path):
    from transformers import HfArgumentParser

    import hf_dp_repr.training.arguments  # noqa: F401 (imported first, on purpose)

    with pytest.raises(DPConfigError, match="unknown clipping_engine 'hooks_logged'"):
        DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, clipping_engine="hooks_logged",
                            report_to="none")

    @register_clipper("hooks_logged")
    class LoggedHooks(HooksClipper):
        how = "by Opacus hooks, logged"

    args = DPTrainingArguments(output_dir=str(tmp_path), noise_multiplier=1.0, clipping_engine="hooks_logged",
                               report_to="none")
    assert args.clipping_engine == "hooks_logged"
    parsed, = HfArgumentParser(DPTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--noise_multiplier", "1", "--clipping_engine", "hooks_logged",
         "--report_to", "none"])
    assert parsed.clipping_engine == "hooks_logged"
