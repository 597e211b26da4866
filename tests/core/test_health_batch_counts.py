"""What the health monitors count in a batch (lightning_fp8.monitoring.measures): its samples and its tokens, the
(batch, sequence) integer ids of a language model, in a tensor or nested lists, tuples and mappings."""

from collections import UserDict

import pytest
import torch

from lightning_fp8.monitoring.measures import count_batch, count_tokens


class _BatchEncoding(UserDict):
    """What transformers' collators return (transformers.BatchEncoding is a UserDict): a mapping, not a dict."""


def test_a_mapping_that_is_not_a_dict_is_counted():
    # Its tensors were not found: (None, None), so no health/tokens_per_sec for a batch from a transformers collator.
    ids = torch.randint(0, 100, (2, 9))
    batch = _BatchEncoding(input_ids=ids, attention_mask=torch.ones_like(ids))
    assert count_batch(batch) == (2, 18) and count_tokens(batch) == 18
    assert count_batch((ids,)) == count_batch({"input_ids": ids}) == (2, 18)


@pytest.mark.parametrize("dtype", [torch.bool, torch.uint8, torch.complex64])
def test_masks_pixels_and_complex_tensors_are_not_token_ids(dtype):
    # A uint8 image batch (8, 3, 32, 32) was 24576 tokens; a bool mask or a complex tensor before the ids was taken
    # for them.
    other = torch.zeros(8, 3, 32, 32, dtype=dtype)
    assert count_tokens([other, torch.zeros(8, dtype=torch.long)]) is None
    assert count_tokens({"other": other, "input_ids": torch.zeros(8, 5, dtype=torch.long)}) == 40
    for dtype in (torch.int64, torch.int32):
        assert count_tokens([torch.zeros(4, 6, dtype=dtype)]) == 24
