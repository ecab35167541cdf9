"""Seed 000's experiment in one command (CI-sized on the embedded default): for each ε and k = 1..L, tune with
Optuna on public data, train with DP on the private split, measure D_l per layer, compare with a constant
learning rate; writes report.md, results.csv and the figures. Logic in `hf_dp_repr.scripts.seed000`.

    python recipes/seed000_sweep.py --output_dir seed000_out --epsilons 1 8 --n_trials 4
"""

from hf_dp_repr.entry_point import CommandParser, prepare_entry_point

prepare_entry_point(tiny_model=True)  # before torch loads; one thread: tiny ViTs (hf_dp_repr/entry_point.py)


def main(argv=None):
    from hf_dp_repr.scripts.seed000 import run_seed000

    p = CommandParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", default="seed000_out")
    p.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 8.0])
    p.add_argument("--ks", type=int, nargs="*", default=None, help="numbers of fine-tuned blocks (default 1..L)")
    p.add_argument("--n_trials", type=int, default=4, help="Optuna trials per (ε, k), on public data")
    p.add_argument("--target_delta", type=float, default=1e-3)
    p.add_argument("--constant_learning_rate", type=float, default=1e-2)
    a = p.parse_args(argv)
    summary = run_seed000(a.output_dir, epsilons=a.epsilons, ks=a.ks, n_trials=a.n_trials, delta=a.target_delta,
                          constant_learning_rate=a.constant_learning_rate)
    print(open(f"{a.output_dir}/report.md").read())
    return summary


if __name__ == "__main__":
    from hf_dp_repr.scripts.runner import run_command

    raise SystemExit(run_command(main))  # one runner: an argument error is one line, exit code 2
