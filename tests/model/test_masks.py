import torch

from megatron.model import GPT2Model, get_ltor_masks_and_position_ids
from tests.model.cases import tiny_config

EOD = 9


def test_no_reset_flags_give_the_causal_fast_path():
    data = torch.tensor([[1, 2, EOD, 3, 4]])
    mask, loss_mask, positions = get_ltor_masks_and_position_ids(data, EOD, False, False,
                                                                 False)
    assert mask is None
    assert torch.equal(loss_mask, torch.ones(1, 5))
    assert torch.equal(positions, torch.arange(5).unsqueeze(0))


def test_reset_flags_on_a_hand_made_example():
    data = torch.tensor([[1, 2, EOD, 3, EOD, 4],
                         [EOD, 5, 6, 7, 8, EOD]])
    mask, loss_mask, positions = get_ltor_masks_and_position_ids(data, EOD, True, True, True)
    assert torch.equal(positions, torch.tensor([[0, 1, 2, 0, 1, 0],
                                                [0, 0, 1, 2, 3, 4]]))
    assert torch.equal(loss_mask, torch.tensor([[1., 1, 0, 1, 0, 1],
                                                [0., 1, 1, 1, 1, 0]]))
    allowed_row0 = torch.tensor([[1, 0, 0, 0, 0, 0],   # doc [1, 2, EOD]
                                 [1, 1, 0, 0, 0, 0],
                                 [1, 1, 1, 0, 0, 0],
                                 [0, 0, 0, 1, 0, 0],   # doc [3, EOD]
                                 [0, 0, 0, 1, 1, 0],
                                 [0, 0, 0, 0, 0, 1]],  # doc [4]
                                dtype=torch.bool)
    allowed_row1 = torch.tensor([[1, 0, 0, 0, 0, 0],   # doc [EOD]
                                 [0, 1, 0, 0, 0, 0],   # doc [5, 6, 7, 8, EOD]
                                 [0, 1, 1, 0, 0, 0],
                                 [0, 1, 1, 1, 0, 0],
                                 [0, 1, 1, 1, 1, 0],
                                 [0, 1, 1, 1, 1, 1]], dtype=torch.bool)
    assert mask.shape == (2, 1, 6, 6) and mask.dtype == torch.bool
    assert torch.equal(mask[0, 0], ~allowed_row0)  # True = masked
    assert torch.equal(mask[1, 0], ~allowed_row1)


def test_only_position_reset_keeps_the_causal_path():
    data = torch.tensor([[1, EOD, 2, 3]])
    mask, loss_mask, positions = get_ltor_masks_and_position_ids(data, EOD, True, False, False)
    assert mask is None and torch.equal(loss_mask, torch.ones(1, 4))
    assert torch.equal(positions, torch.tensor([[0, 1, 0, 1]]))


def test_documents_do_not_see_each_other():
    torch.manual_seed(0)
    model = GPT2Model(tiny_config()).eval()
    data = torch.tensor([[5, 6, EOD, 7, 8, 10, 11, 12]])
    other = data.clone()
    other[0, :2] = torch.tensor([30, 31])  # change only the first document
    with torch.no_grad():
        outputs = []
        for tokens in (data, other):
            mask, _, positions = get_ltor_masks_and_position_ids(tokens, EOD, True, True,
                                                                 False)
            outputs.append(model(tokens, positions, mask))
    torch.testing.assert_close(outputs[0][:, 3:], outputs[1][:, 3:])
    assert not torch.allclose(outputs[0][:, :2], outputs[1][:, :2])


def test_explicit_causal_mask_equals_fast_path():
    torch.manual_seed(0)
    model = GPT2Model(tiny_config()).eval()
    data = torch.tensor([[5, 6, 7, 8, 10, 11]])  # no eod: the reset mask is plain causal
    mask, _, positions = get_ltor_masks_and_position_ids(data, EOD, False, True, False)
    with torch.no_grad():
        torch.testing.assert_close(model(data, positions, mask), model(data, positions))
