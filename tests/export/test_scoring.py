from export.scoring import edit_distance, score, strip_stress


def test_edit_distance() -> None:
    assert edit_distance("kitten", "sitting") == 3
    assert edit_distance([], ["A"]) == 1
    assert edit_distance(["AH0", "T"], ["AH0", "T"]) == 0


def test_wer_and_per_on_known_examples() -> None:
    refs = [[["HH", "AH0", "L", "OW1"], ["HH", "EH0", "L", "OW1"]], [["W", "ER1", "L", "D"]]]
    preds = [["HH", "EH0", "L", "OW1"], ["W", "ER0", "L"]]  # first matches its 2nd variant
    s = score(preds, refs)
    assert s["wer"] == 0.5
    assert s["per"] == 2 / 8  # 0 errors + (1 substitution + 1 deletion) over 4 + 4 phonemes
    assert s["wer_stress_free"] == 0.5  # the deletion remains without stress
    assert s["per_stress_free"] == 1 / 8


def test_strip_stress() -> None:
    assert strip_stress(["AH0", "T", "EH1"]) == ["AH", "T", "EH"]
