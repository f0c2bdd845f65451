"""tools/pipeline_timeline.py: the PNG and trace of a synthetic timeline, the bubble arithmetic, our DualPipeV order
against torch's ScheduleDualPipeV and the DualPipe formula, and one gloo run of the stand-in through the CLI."""

import json
import struct
import zlib

import pytest

from tools import pipeline_timeline as pt


def read_png(path):
    """(width, height, raw scanlines) of a PNG, checking the signature and every chunk's CRC."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, {}
    while pos < len(data):
        (length,), kind = struct.unpack(">I", data[pos:pos + 4]), data[pos + 4:pos + 8]
        body, crc = data[pos + 8:pos + 8 + length], data[pos + 8 + length:pos + 12 + length]
        assert struct.unpack(">I", crc)[0] == zlib.crc32(kind + body)
        chunks[kind] = chunks.get(kind, b"") + body
        pos += 12 + length
    width, height, depth, colour_type = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert (depth, colour_type) == (8, 2) and b"IEND" in chunks
    return width, height, zlib.decompress(chunks[b"IDAT"])


def test_draw_synthetic_timeline(tmp_path):
    timelines = [[("F0", 0.0, 1.0), ("F0&B1", 1.0, 3.0), ("W", 4.0, 5.0)],
                 [("F1", 0.5, 1.5), ("B0", 2.0, 4.0)]]
    stats = pt.draw_timeline(timelines, tmp_path / "t.png", tmp_path / "t.json")
    # span 0..5 s; busy 4 s and 3 s: bubble fraction = 1 - 7 / (2 * 5)
    assert stats["span"] == 5.0 and stats["busy"] == [4.0, 3.0] and stats["bubble"] == [1.0, 2.0]
    assert stats["bubble_fraction"] == pytest.approx(0.3)

    width, height, raw = read_png(tmp_path / "t.png")
    assert len(raw) == width * height * 3 + height and 200 <= width <= 1200
    assert all(raw[row * (width * 3 + 1)] == 0 for row in range(height))  # filter byte of every scanline
    for key in [("F", 0), ("F", 1), ("B", 0), ("B", 1), ("W", None)]:
        assert bytes(pt.COLOURS[key]) in raw

    trace = json.load(open(tmp_path / "t.json"))
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 5 and {e["tid"] for e in events} == {0, 1} and all(e["pid"] == 0 for e in events)
    assert events[1] == {"name": "F0&B1", "ph": "X", "pid": 0, "tid": 0, "ts": 1e6, "dur": 2e6}


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
    assert (tmp_path / "timeline.png").exists() and (tmp_path / "trace.json").exists()
