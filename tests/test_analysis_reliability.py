"""Numbers the analyzer itself calls meaningless are flagged and withheld, not printed plainly; the README's examples
use enough rows and can be checked as written (issue 23, item 9)."""

import argparse
import json
import re
from pathlib import Path

import pytest

from hf_dp_repr.analysis import analyze_representations
from hf_dp_repr.analysis.analyze_cli import add_analyze_parser, summary_table
from hf_dp_repr.analysis.law_report import RepresentationReport
from hf_dp_repr.tiny import tiny_vit

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
RECIPES_PAGE = (ROOT / "docs" / "recipes.md").read_text()  # the recipes and the CLI


def test_a_residual_with_fewer_rows_than_dims_is_flagged_and_withheld(digits):
    model = tiny_vit()  # 64-dim features
    few = analyze_representations(model, digits["test"], max_examples=40, batch_size=40)
    assert "40 rows for 64-dim features" in few.unreliable["residual"] and "fuzziness" not in few.unreliable
    assert few.to_dict()["unreliable"] == few.unreliable
    assert not [k for k in few.metrics() if k.startswith("repr/residual")]  # trackers get no unflagged number
    assert [k for k in few.metrics() if k.startswith("repr/fuzziness")]
    enough = analyze_representations(model, digits["test"], batch_size=128)  # 360 rows > 65
    assert enough.unreliable == {} and enough.to_dict()["residual_law"]["reliable"] is True
    assert f"{enough.residual_law.rho:.3f}" in summary_table({"tiny": {"model": "tiny", **enough.to_dict()}})
    # a fit that exists although the analyzer calls it meaningless (as MiniLM's on 287 rows): flagged, withheld
    flagged = RepresentationReport(**{**vars(enough), "unreliable": {"residual": few.unreliable["residual"]}})
    data = json.loads(json.dumps(flagged.to_dict()))
    assert data["residual_law"]["reliable"] is False and data["fuzziness_law"]["reliable"] is True
    assert data["residual_law"]["unreliable_reason"] == few.unreliable["residual"]
    assert RepresentationReport.from_dict(data).unreliable == flagged.unreliable
    table = summary_table({"tiny": {"model": "tiny", **data}})
    row = table.splitlines()[2]
    assert "| withheld† |" in row and f"{enough.residual_law.rho:.3f}" not in row
    assert f"{enough.fuzziness_law.rho:.3f}" in row
    assert table.splitlines()[-1].startswith("† withheld: only 40 rows for 64-dim features")


def test_analyze_cli_marks_the_withheld_law_in_table_and_json(tmp_path, capsys):
    path = tmp_path / "vit"
    tiny_vit().save_pretrained(path)
    parser = argparse.ArgumentParser()
    add_analyze_parser(parser.add_subparsers())
    args = parser.parse_args(["analyze", "--model", str(path), "--dataset", "digits", "--max-examples", "40",
                              "--out", str(tmp_path / "law")])
    with pytest.warns(UserWarning, match="only 40 rows for 64-dim features"):
        assert args.func(args) == 0
    assert "withheld†" in capsys.readouterr().out
    saved = json.loads((tmp_path / "law" / "representation_law.json").read_text())
    assert "40 rows for 64-dim features" in saved["models"]["vit"]["unreliable"]["residual"]


def test_the_documented_minilm_analysis_reads_more_rows_than_minilms_feature_dims():
    from hf_dp_repr.data import load_embedded

    command = re.search(r"hf-dp-repr analyze --model sentence-transformers/all-MiniLM-L6-v2.*?--out", RECIPES_PAGE,
                        re.S).group(0)
    split = re.search(r"--split (\S+)", command)
    rows = load_embedded("stdlib-topics")[split.group(1) if split else "test"].num_rows
    assert rows > 384 + 1, f"the documented MiniLM command reads {rows} rows: PR_l of 384-dim features is an exact fit"

