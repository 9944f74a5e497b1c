"""A real Orbax CheckpointManager (CPU) with two items per step: "state" (a PyTree, StandardSave)
and "meta" (JsonSave).

  python orbax_job.py save DIR STEPS_CSV    -> DIR/<step>/{state,meta,_CHECKPOINT_METADATA,...}
  python orbax_job.py restore DIR STEP      -> {"restore": "ok"|error}  (mngr.restore(step, args=Composite(...)))
"""
import json, os, sys
os.environ.setdefault("JAX_PLATFORMS", "cpu")
import numpy as np
import orbax.checkpoint as ocp

def tree(s):
    return {"w": np.arange(4096, dtype=np.float32) * s, "b": np.ones(64, dtype=np.float32) * s}

if __name__ == "__main__":
    mode, d = sys.argv[1], os.path.abspath(sys.argv[2])
    mngr = ocp.CheckpointManager(d, options=ocp.CheckpointManagerOptions(max_to_keep=None))
    if mode == "save":
        for s in [int(x) for x in sys.argv[3].split(",")]:
            mngr.save(s, args=ocp.args.Composite(state=ocp.args.StandardSave(tree(s)), meta=ocp.args.JsonSave({"step": s})))
        mngr.wait_until_finished()
        print(json.dumps({"steps": mngr.all_steps()}))
    else:
        s = int(sys.argv[3])
        try:
            r = mngr.restore(s, args=ocp.args.Composite(state=ocp.args.StandardRestore(tree(0)), meta=ocp.args.JsonRestore()))
            assert float(r["state"]["b"][0]) == s
            res = "ok"
        except BaseException as e:  # noqa
            res = f"{type(e).__name__}: {e}"[:300]
        print(json.dumps({"restore": res, "all_steps": mngr.all_steps(), "latest": mngr.latest_step()}))
