"""Host tensors to the device in one copy: the packing round-trips every dtype and shape."""
import torch

from runtime.transfer import ALIGN, packed, to_device_at_once, unpacked


def test_packed_tensors_come_back_as_aligned_views_of_one_buffer():
    tensors = [torch.arange(5), torch.tensor([[1, -2, 3]], dtype=torch.int32), torch.tensor([True, False, True]),
               torch.zeros(0, dtype=torch.long), torch.arange(6).reshape(2, 3)[:, ::2]]  # the last not contiguous
    buffer, offsets = packed(tensors)
    assert buffer.dtype == torch.uint8 and all(o % ALIGN == 0 for o in offsets)
    for got, want in zip(unpacked(buffer, offsets, tensors), tensors):
        assert got.dtype == want.dtype and torch.equal(got, want)
        assert got.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def test_on_the_cpu_the_tensors_are_themselves():
    t = torch.arange(3)
    assert to_device_at_once([t], torch.device("cpu"))[0] is t
