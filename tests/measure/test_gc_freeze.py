"""LongLivedFreeze (novatune/measure/gc_freeze.py): frozen after the first step, released only by its owner; used by
`novatune train` (tests/train/test_train.py), the bench worker and `novatune.patch(trainer)`
(tests/patch/test_trainer_syncs.py)."""
import gc

from novatune.measure.gc_freeze import LongLivedFreeze


def test_freeze_then_release_hands_everything_back():
    held = LongLivedFreeze()
    try:
        assert gc.get_freeze_count() == 0
        held.freeze()
        assert gc.get_freeze_count() > 0
        held.freeze()  # a second freeze by the same owner: still its own
        held.release()
        assert gc.get_freeze_count() == 0
        held.release()  # once is enough
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()


def test_a_freeze_someone_made_before_stays():
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        held = LongLivedFreeze()
        held.freeze()
        held.release()
        assert gc.get_freeze_count() >= before > 0
    finally:
        gc.unfreeze()
