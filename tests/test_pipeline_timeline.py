"""tools/pipeline_timeline.py: the trace and PNG of a synthetic timeline, the bubble arithmetic, our DualPipeV order
against torch's ScheduleDualPipeV and the DualPipe formula, and one gloo run of the stand-in through the CLI."""

import json

import pytest

from tools import pipeline_timeline as pt


def test_draw_synthetic_timeline(tmp_path, capsys):
    timelines = [[("F0", 0.0, 1.0), ("F0&B1", 1.0, 3.0), ("W", 4.0, 5.0)],
                 [("F1", 0.5, 1.5), ("B0", 2.0, 4.0)]]
    stats = pt.timeline_stats(timelines)
    # span 0..5 s; busy 4 s and 3 s: bubble fraction = 1 - 7 / (2 * 5)
    assert stats["span"] == 5.0 and stats["busy"] == [4.0, 3.0] and stats["bubble"] == [1.0, 2.0]
    assert stats["bubble_fraction"] == pytest.approx(0.3)

    pt.write_trace(timelines, tmp_path / "t.json")
    trace = json.load(open(tmp_path / "t.json"))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 5 and {e["tid"] for e in events} == {0, 1} and all(e["pid"] == 0 for e in events)
    assert events[1] == {"name": "F0&B1", "ph": "X", "pid": 0, "tid": 0, "ts": 1e6, "dur": 2e6}

    labels = [["F0.0", "F0.1&B1.7", "W0.0"], ["F1.0", "B0.0"]]
    drawn = pt.draw_png(timelines, tmp_path / "t.png", labels)
    try:
        import matplotlib.colors
        import matplotlib.image
    except ImportError:  # the PNG needs the optional extra; the numbers above do not
        assert not drawn and capsys.readouterr().out.strip() == pt.NO_MATPLOTLIB and not (tmp_path / "t.png").exists()
        pytest.skip("matplotlib not installed: PNG drawing not checked")

    img = matplotlib.image.imread(tmp_path / "t.png")[..., :3]  # float RGB in [0, 1]
    assert drawn and 800 <= img.shape[1] <= 2500 and 150 <= img.shape[0] <= 600
    pixels = {tuple(p) for p in (img * 255).round().astype(int).reshape(-1, 3).tolist()}
    for colour in set(pt.COLOURS.values()):  # every kind of box is drawn in its own colour
        assert tuple(round(c * 255) for c in matplotlib.colors.to_rgb(colour)) in pixels, colour


@pytest.mark.parametrize("pp", [2, 3, 4])
def test_order_matches_torch_and_formula(pp):
    for num_micro in (2 * pp, 2 * pp + 3):
        assert pt.schedule_order(pp, num_micro) == pt.torch_schedule_order(pp, num_micro)
    # replaying the order with F = I = W = 1, B = 2, F&B = 3 and free transfers gives the README's bubble exactly
    stats = pt.timeline_stats(pt.simulate(pt.schedule_order(pp, 12), {"F": 1, "I": 1, "W": 1, "B": 2, "F&B": 3}))
    assert stats["bubble"] == [pt.formula_bubble(pp, 1, 2, 1, 3)] * pp == [2 * (pp - 1)] * pp
    assert pt.formula_bubble(pp, 1, 2, 1, None) == pt.formula_bubble(pp, 1, 2, 1, 3)  # no overlap: F&B = F + B
    with pytest.raises(ValueError, match="at least 2\\*pp"):
        pt.schedule_order(pp, 2 * pp - 1)


def test_cli_on_gloo(tmp_path, capsys):
    num_micro = 5
    pt.main(["--pp", "2", "--micro", str(num_micro), "--steps", "1", "--out", str(tmp_path)])
    timelines = json.load(open(tmp_path / "timelines.json"))
    for tl, order in zip(timelines, pt.schedule_order(2, num_micro)):
        ops = [op for op, *_ in tl]
        assert ops == [pt.engine_name(a) for a in order]  # the dry run predicts what the engine records
        assert sum(op.count("F") for op in ops) == sum(op.count("B") for op in ops) == 2 * num_micro
        assert ops.count("W") > 0 and any("&" in op for op in ops)
        assert all(s <= e for _, s, e in tl)
    out = capsys.readouterr().out
    assert "bubble fraction" in out and "DualPipe formula" in out and out.count("identical") == 2
    assert (tmp_path / "trace.json").exists()  # the PNG only with matplotlib, else one line says why not
    assert (tmp_path / "timeline.png").exists() == (pt.NO_MATPLOTLIB not in out)
