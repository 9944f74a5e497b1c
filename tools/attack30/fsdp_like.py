"""accelerate's FSDP SHARDED_STATE_DICT layout, written with the frameworks' own writers on the CPU:
Accelerator.save_state(DIR) (one CPU process), then torch.distributed.checkpoint.save of the model's
state dict into DIR/pytorch_model_fsdp_0 and of the optimizer's into DIR/optimizer_0, as
accelerate/utils/fsdp_utils.py save_fsdp_model / save_fsdp_optimizer call it (FSDP itself cannot run
on the CPU here; tests/support/fwdcp_nested.py does the same for the model).

  python fsdp_like.py save DIR      python fsdp_like.py load DIR  -> {"model": ..., "optimizer": ...}
"""
import json, os, sys
import torch
import torch.distributed.checkpoint as dcp


def parts():
    from accelerate import Accelerator
    torch.manual_seed(0)
    acc = Accelerator(cpu=True)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    o = torch.optim.AdamW(m.parameters())
    m, o = acc.prepare(m, o)
    return acc, m, o


if __name__ == "__main__":
    d = sys.argv[2]
    acc, m, o = parts()
    if sys.argv[1] == "save":
        acc.backward(m(torch.randn(2, 64)).sum()); o.step()
        acc.save_state(d)
        dcp.save({"model": m.state_dict()}, storage_writer=dcp.FileSystemWriter(os.path.join(d, "pytorch_model_fsdp_0")))
        dcp.save({"optimizer": o.state_dict()}, storage_writer=dcp.FileSystemWriter(os.path.join(d, "optimizer_0")))
        print(json.dumps({"saved": d}))
    else:
        res = {}
        for name, key, sd in (("pytorch_model_fsdp_0", "model", m.state_dict()), ("optimizer_0", "optimizer", o.state_dict())):
            try:
                dcp.load({key: sd}, checkpoint_id=os.path.join(d, name))
                res[key] = "ok"
            except BaseException as e:  # noqa  (CheckpointException is a BaseException)
                res[key] = f"{type(e).__name__}: {e}"[:200]
        print(json.dumps(res))
