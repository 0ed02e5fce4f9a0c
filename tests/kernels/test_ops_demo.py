"""``python -m macer_kernels.demo``: the ops-only readout says why some temporal chunks are empty."""

from macer_kernels.demo import main


def test_demo_explains_empty_chunks(capsys):
    main([])
    text = capsys.readouterr().out
    # 6 temporal groups (12 frames, 2 per group) in 8 chunks: floor(8 g / 6) skips chunks 3 and 7.
    assert "c3=0/0" in text and "c7=0/0" in text
    assert "(c3, c7 hold no tokens: the clip has 6 temporal groups of 2 frames for 8 chunks" in text
    assert "budget (rho=0.25, alpha=0.3): K_mm=581 -> K_a=174, K_v=407" in text
