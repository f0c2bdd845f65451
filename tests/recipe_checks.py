"""Checks every recipe's tests run the same way (each recipe module passed in: recipes are copies, their tests
are not): a partial model reads only its tensors, transformers' aux loss and router gradients, and a Hugging
Face folder that goes through train.py with lr 0 comes out unchanged."""

import torch

from tools.hf_parity import folder_tensors


def assert_partial_model_reads_only_its_tensors(recipe, path, num_tensors: int) -> None:
    """Layer 1 with experts 2 and 3 only, no embedding or head: `num_tensors` HF tensors read, all of layer 1,
    and the partial model's weights are exactly the full model's slice."""
    cfg = recipe.ModelConfig.from_hf(path)
    full = recipe.Model(cfg)
    recipe.load_hf_checkpoint(full, path)
    part = recipe.Model(cfg, layers=[1], experts=(2, 4), embed=False, head=False)
    names = recipe.load_hf_checkpoint(part, path)
    assert all(n.startswith("model.layers.1.") for n in names)
    experts_read = {int(n.split(".")[5]) for n in names if ".mlp.experts." in n and n.split(".")[5].isdigit()}
    assert experts_read in (set(), {2, 3})  # per-expert keys: 2 and 3 only (fused keys: sliced rows, not named)
    assert len(names) == len(set(names)) == num_tensors, sorted(names)
    full_sd = full.state_dict()
    for key, value in part.state_dict().items():
        ref = full_sd[key][2:4] if ".mlp.experts." in key else full_sd[key]
        assert torch.equal(value, ref), key


def assert_aux_loss_matches(ref, model, ids, grad_pairs) -> None:
    """transformers' aux_loss (output_router_logits) equals forward_train's, and the gradients of each
    (ours, transformers') parameter pair in grad_pairs() agree to 1e-5 relative."""
    ref_aux = ref(input_ids=ids, output_router_logits=True).aux_loss
    aux = model.forward_train(ids, ids).aux_loss
    torch.testing.assert_close(aux, ref_aux, rtol=1e-6, atol=0)
    ref_aux.backward()
    aux.backward()
    for ours, theirs in grad_pairs():
        assert ((ours.grad - theirs.grad).norm() / theirs.grad.norm()).item() <= 1e-5


def assert_export_keeps_the_weights(main, data, run_dir, hf_in, hf_out) -> None:
    """train.py --hf-checkpoint hf_in --lr 0 --export-hf hf_out: every tensor comes back bit for bit."""
    from tests.test_train import train_args

    main(train_args("unused", data, run_dir, steps=1, lr=0.0, hf_checkpoint=hf_in, export_hf=hf_out))
    before, after = folder_tensors(hf_in), folder_tensors(hf_out)
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(before[name], after[name]), name
