"""Keras save_weights (.weights.h5) / model.save (.keras) killed at chosen points of h5py's writes.
  python keras_probe.py OUT KIND POINT   KIND weights|keras; POINT: after_create | after_first_var | none
"""
import os, signal, sys
os.environ.setdefault("KERAS_BACKEND", "torch")
import keras, numpy as np
from keras.src.saving import saving_lib

out, kind, point = sys.argv[1], sys.argv[2], sys.argv[3]
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(64), keras.layers.Dense(1)])
model.compile(optimizer="adam", loss="mse")
x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
model.fit(x, x.sum(1, keepdims=True), epochs=1, verbose=0)
orig_init = saving_lib.H5IOStore.__init__
orig_set = saving_lib.H5IOStore.__setitem__ if hasattr(saving_lib.H5IOStore, "__setitem__") else None
def init(self, *a, **k):
    orig_init(self, *a, **k)
    if point == "after_create":
        os.kill(os.getpid(), signal.SIGKILL)
saving_lib.H5IOStore.__init__ = init
if orig_set:
    def setitem(self, *a, **k):
        orig_set(self, *a, **k)
        if point == "after_first_var":
            os.kill(os.getpid(), signal.SIGKILL)
    saving_lib.H5IOStore.__setitem__ = setitem
path = os.path.join(out, "ckpt-epoch=02.weights.h5" if kind == "weights" else "ckpt-epoch=02.keras")
if kind == "weights":
    model.save_weights(path)
else:
    model.save(path)
print("saved")
