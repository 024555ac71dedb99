// attnselect.call_memo's check of the recent calls, in C++: one call compares a call's options, the thread's
// state and its tensors' metadata against each recent call (attnselect/compiled.py builds it; call_memo.py's
// docstring says what a call is known by). What torch exposes to Python for the same checks (TensorGuards, the
// tensor getters, the grad and deterministic flags) costs host time per call; here each is a field read.
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ATen/Context.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <vector>

namespace {

// The option tuple (attnselect.call.CallOptions' fields) and the positions of its tensors: compared by pattern, not
// by value (layout, ..., cu_seqlens_q 5, cu_seqlens_kv 6, ..., cu_seqlens_q_padded 9, cu_seqlens_kv_padded 10,
// ..., sinks 13, ..., cp_group 15, ...).
constexpr Py_ssize_t kOptions = 19;
constexpr Py_ssize_t kCuQ = 5, kCuKv = 6, kCuQPadded = 9, kCuKvPadded = 10, kSinks = 13, kCpGroup = 15;
constexpr int kMaxTensors = 5;  // q, k, v, cu_seqlens_q, sinks
constexpr const char* kCapsule = "attnselect.recent_call";

bool is_tensor_slot(Py_ssize_t i) {
  return i == kCuQ || i == kCuKv || i == kCuQPadded || i == kCuKvPadded || i == kSinks || i == kCpGroup;
}

// What a tensor is checked by, as TensorGuards checks it (torch/csrc/dynamo/guards.cpp TensorCheck: Python type,
// dispatch keys after the thread's included and excluded keys, dtype, device, requires_grad, sizes, strides), and
// its storage offset.
struct TensorMeta {
  PyTypeObject* type;  // held by the entry
  uint64_t keys;
  at::ScalarType dtype;
  c10::Device device;
  bool requires_grad;
  std::vector<int64_t> sizes, strides;
  int64_t offset;
};

struct Entry {
  PyObject* options;  // the call's options, its tensors replaced by None
  int pattern;        // which of q, k, v are one tensor; cu_seqlens_kv None or cu_seqlens_q
  bool grad, deterministic, function_mode;
  PyObject* environment;  // None where no ATTNSELECT_* variable was set, else their raw values
  PyObject* scope;        // the overrides() scope
  int capturing;          // -1: not on CUDA; else the CUDA graph capture state of the call
  std::vector<TensorMeta> tensors;
  PyObject* known;
};

PyObject *g_scope_var, *g_environ, *g_names, *g_raw_environment, *g_memo, *g_raw_stream_name, *g_capturing_name;

uint64_t applied_keys(const at::Tensor& t, const c10::impl::LocalDispatchKeySet& local) {
  return ((t.key_set() | local.included_) - local.excluded_).raw_repr();
}

bool same_value(PyObject* a, PyObject* b) {
  // Equal and of one type: 1 == True and 2.0 == 2 compare equal, and the slow path refuses what it must.
  if (a == b) return true;
  if (Py_TYPE(a) != Py_TYPE(b)) return false;
  if (PyTuple_CheckExact(a)) {
    Py_ssize_t n = PyTuple_GET_SIZE(a);
    if (n != PyTuple_GET_SIZE(b)) return false;
    for (Py_ssize_t i = 0; i < n; i++)
      if (!same_value(PyTuple_GET_ITEM(a, i), PyTuple_GET_ITEM(b, i))) return false;
    return true;
  }
  int equal = PyObject_RichCompareBool(a, b, Py_EQ);
  if (equal < 0) PyErr_Clear();
  return equal == 1;
}

// The call's tensors, each once (aliases), in call_memo's order: q, k, v, cu_seqlens_q, sinks. False where a tensor
// is not one or is nested (TensorGuards cannot check a nested tensor; validation names it).
bool call_tensors(PyObject* const* qkv, PyObject* options, int* pattern, PyObject** out, int* n) {
  PyObject *q = qkv[0], *k = qkv[1], *v = qkv[2];
  PyObject* cu_q = PyTuple_GET_ITEM(options, kCuQ);
  PyObject* cu_kv = PyTuple_GET_ITEM(options, kCuKv);
  PyObject* sinks = PyTuple_GET_ITEM(options, kSinks);
  if ((cu_kv != Py_None && cu_kv != cu_q) || PyTuple_GET_ITEM(options, kCpGroup) != Py_None) return false;
  *pattern = (k == q) | (v == q) << 1 | (v == k) << 2 | (cu_q != Py_None) << 3 | (cu_kv != Py_None) << 4 |
             (sinks != Py_None) << 5;
  *n = 0;
  out[(*n)++] = q;
  if (k != q) out[(*n)++] = k;
  if (v != q && v != k) out[(*n)++] = v;
  if (cu_q != Py_None) out[(*n)++] = cu_q;
  if (sinks != Py_None) out[(*n)++] = sinks;
  for (int i = 0; i < *n; i++) {
    if (!THPVariable_Check(out[i])) return false;
    const at::Tensor& t = THPVariable_Unpack(out[i]);
    // sizes() and strides() would throw on these (a nested tensor's, symbolic ones); others that throw (a sparse
    // tensor's strides) are caught where they are read
    if (!t.defined() || t.is_nested() || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return false;
  }
  return true;
}

PyObject* environment() {  // None where no ATTNSELECT_* variable is set (the usual case), else their raw values
  Py_ssize_t n = PyTuple_GET_SIZE(g_names);
  for (Py_ssize_t i = 0; i < n; i++) {
    int found = PyDict_Contains(g_environ, PyTuple_GET_ITEM(g_names, i));
    if (found < 0) return nullptr;
    if (found) return PyObject_CallNoArgs(g_raw_environment);
  }
  Py_RETURN_NONE;
}

// CUDA graph capture on the current stream, read as call_memo reads it (its raw_stream and stream_capturing, looked up
// at each read): only off the default stream.
int capturing_now() {
  PyObject* minus_one = PyLong_FromLong(-1);
  PyObject* stream = PyObject_CallMethodOneArg(g_memo, g_raw_stream_name, minus_one);
  Py_DECREF(minus_one);
  if (!stream) return -1;
  long long raw = PyLong_AsLongLong(stream);
  Py_DECREF(stream);
  if (raw == -1 && PyErr_Occurred()) return -1;
  if (raw == 0) return 0;
  PyObject* capturing = PyObject_CallMethodNoArgs(g_memo, g_capturing_name);
  if (!capturing) return -1;
  int result = capturing == Py_True;
  Py_DECREF(capturing);
  return result;
}

void destroy_entry(PyObject* capsule) {
  auto* entry = static_cast<Entry*>(PyCapsule_GetPointer(capsule, kCapsule));
  Py_XDECREF(entry->options);
  Py_XDECREF(entry->environment);
  Py_XDECREF(entry->scope);
  Py_XDECREF(entry->known);
  for (const TensorMeta& meta : entry->tensors) Py_DECREF(meta.type);
  delete entry;
}

// configure(scope_var, environ, names, raw_environment, call_memo): where the state is read from
// (attnselect.settings.state_sources, and the call_memo module). Called again, it replaces them.
PyObject* configure(PyObject*, PyObject* args) {
  PyObject *scope_var, *environ, *names, *raw_environment, *memo;
  if (!PyArg_ParseTuple(args, "O!O!O!OO", &PyContextVar_Type, &scope_var, &PyDict_Type, &environ, &PyTuple_Type,
                        &names, &raw_environment, &memo))
    return nullptr;
  if (!g_raw_stream_name) {
    g_raw_stream_name = PyUnicode_InternFromString("raw_stream");
    g_capturing_name = PyUnicode_InternFromString("stream_capturing");
    if (!g_raw_stream_name || !g_capturing_name) return nullptr;
  }
  PyObject** globals[] = {&g_scope_var, &g_environ, &g_names, &g_raw_environment, &g_memo};
  PyObject* values[] = {scope_var, environ, names, raw_environment, memo};
  for (int i = 0; i < 5; i++) {
    Py_INCREF(values[i]);
    Py_XSETREF(*globals[i], values[i]);
  }
  Py_RETURN_NONE;
}

// entry(q, k, v, options, capturing, known) -> an opaque entry for find(), made right after the call was decided.
PyObject* entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 6 || !PyTuple_Check(args[3]) || PyTuple_GET_SIZE(args[3]) != kOptions || !g_scope_var) {
    PyErr_SetString(PyExc_TypeError, "entry(q, k, v, options, capturing, known)");
    return nullptr;
  }
  PyObject* options = args[3];
  PyObject* tensors[kMaxTensors];
  int pattern, n;
  if (!call_tensors(args, options, &pattern, tensors, &n)) {
    PyErr_SetString(PyExc_ValueError, "entry: a call the memo cannot know");
    return nullptr;
  }
  PyObject *env = environment(), *scope = nullptr;
  if (!env || PyContextVar_Get(g_scope_var, nullptr, &scope) < 0) {
    Py_XDECREF(env);
    return nullptr;
  }
  PyObject* stored = PyTuple_New(kOptions);
  if (!stored) {
    Py_DECREF(env);
    Py_DECREF(scope);
    return nullptr;
  }
  auto* e = new Entry();
  e->environment = env;
  e->scope = scope;
  e->options = stored;
  for (Py_ssize_t i = 0; i < kOptions; i++) {
    PyObject* item = is_tensor_slot(i) ? Py_None : PyTuple_GET_ITEM(options, i);
    Py_INCREF(item);
    PyTuple_SET_ITEM(e->options, i, item);
  }
  e->pattern = pattern;
  e->grad = c10::GradMode::is_enabled();
  e->deterministic = at::globalContext().deterministicAlgorithms();
  e->function_mode = at::impl::torch_function_mode_enabled();
  e->capturing = args[4] == Py_None ? -1 : args[4] == Py_True;
  Py_INCREF(args[5]);
  e->known = args[5];
  auto local = c10::impl::tls_local_dispatch_key_set();
  PyObject* capsule = nullptr;
  try {
    for (int i = 0; i < n; i++) {
      const at::Tensor& t = THPVariable_Unpack(tensors[i]);
      TensorMeta meta{Py_TYPE(tensors[i]), applied_keys(t, local), t.scalar_type(), t.device(),
                      t.requires_grad(), t.sizes().vec(), t.strides().vec(), t.storage_offset()};
      Py_INCREF(meta.type);
      e->tensors.push_back(std::move(meta));
    }
    capsule = PyCapsule_New(e, kCapsule, destroy_entry);
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_ValueError, error.what());
  }
  if (!capsule) {
    for (const TensorMeta& meta : e->tensors) Py_DECREF(meta.type);
    Py_DECREF(e->options);
    Py_DECREF(env);
    Py_DECREF(scope);
    Py_DECREF(e->known);
    delete e;
  }
  return capsule;
}

bool same_tensor(const TensorMeta& m, PyObject* obj, const c10::impl::LocalDispatchKeySet& local) {
  const at::Tensor& t = THPVariable_Unpack(obj);
  return Py_TYPE(obj) == m.type && applied_keys(t, local) == m.keys && t.scalar_type() == m.dtype &&
         t.device() == m.device && t.requires_grad() == m.requires_grad && t.sizes().equals(m.sizes) &&
         t.strides().equals(m.strides) && t.storage_offset() == m.offset;
}

// 1 where the call matches the entry, 0 where not, -1 on a Python error. The environment, the scope and the capture
// state are read once per call, at the first entry that needs them.
int matches(PyObject* item, PyObject* options, int pattern, PyObject* const* tensors, int n, bool grad,
            bool deterministic, bool function_mode, const c10::impl::LocalDispatchKeySet& local, PyObject** env,
            PyObject** scope, int* capturing) {
  auto* e = static_cast<Entry*>(PyCapsule_GetPointer(item, kCapsule));
  if (!e) return -1;
  if (e->pattern != pattern || e->grad != grad || e->deterministic != deterministic ||
      e->function_mode != function_mode || static_cast<int>(e->tensors.size()) != n)
    return 0;
  for (Py_ssize_t j = 0; j < kOptions; j++)
    if (!is_tensor_slot(j) && !same_value(PyTuple_GET_ITEM(options, j), PyTuple_GET_ITEM(e->options, j))) return 0;
  try {
    for (int j = 0; j < n; j++)
      if (!same_tensor(e->tensors[j], tensors[j], local)) return 0;
  } catch (const std::exception&) {  // a layout without strides: not known
    PyErr_Clear();
    return 0;
  }
  if (!*env && !(*env = environment())) return -1;
  if (!same_value(*env, e->environment)) return 0;
  if (!*scope && PyContextVar_Get(g_scope_var, nullptr, scope) < 0) return -1;
  if (!same_value(*scope, e->scope)) return 0;
  if (e->capturing != -1) {
    if (*capturing == -2 && (*capturing = capturing_now()) < 0) return -1;
    if (*capturing != e->capturing) return 0;
  }
  return 1;
}

// find(entries, q, k, v, options) -> the known call of the first entry the call matches, or None.
PyObject* find(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !PyList_CheckExact(args[0]) || !g_scope_var) {
    PyErr_SetString(PyExc_TypeError, "find(entries, q, k, v, options), after configure()");
    return nullptr;
  }
  PyObject *entries = args[0], *options = args[4];
  if (!PyTuple_Check(options) || PyTuple_GET_SIZE(options) != kOptions) Py_RETURN_NONE;
  if (PyTuple_GET_ITEM(options, kCuQPadded) != Py_None || PyTuple_GET_ITEM(options, kCuKvPadded) != Py_None)
    Py_RETURN_NONE;
  PyObject* tensors[kMaxTensors];
  int pattern, n;
  if (!call_tensors(args + 1, options, &pattern, tensors, &n)) Py_RETURN_NONE;
  bool grad = c10::GradMode::is_enabled();
  bool deterministic = at::globalContext().deterministicAlgorithms();
  bool function_mode = at::impl::torch_function_mode_enabled();
  auto local = c10::impl::tls_local_dispatch_key_set();
  PyObject *env = nullptr, *scope = nullptr, *result = nullptr;
  int capturing = -2;  // not read yet
  bool failed = false;
  // Entries are None where made before this library was loaded. Each is held while checked: reading the
  // environment or the capture state runs Python, where another thread may change the list.
  for (Py_ssize_t i = 0; !result && !failed && i < PyList_GET_SIZE(entries); i++) {
    PyObject* item = PyList_GET_ITEM(entries, i);
    if (item == Py_None) continue;
    Py_INCREF(item);
    int match = matches(item, options, pattern, tensors, n, grad, deterministic, function_mode, local, &env, &scope,
                        &capturing);
    if (match == 1) {
      result = static_cast<Entry*>(PyCapsule_GetPointer(item, kCapsule))->known;
      Py_INCREF(result);
    }
    failed = match < 0;
    Py_DECREF(item);
  }
  Py_XDECREF(env);
  Py_XDECREF(scope);
  if (failed) return nullptr;
  if (!result) Py_RETURN_NONE;
  return result;
}

PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, "configure(scope_var, environ, names, raw_environment, call_memo)"},
    {"entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(entry)), METH_FASTCALL,
     "entry(q, k, v, options, capturing, known): a recent call"},
    {"find", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(find)), METH_FASTCALL,
     "find(entries, q, k, v, options): the known call of the first entry the call matches, or None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "attnselect_recent_calls", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_attnselect_recent_calls() { return PyModule_Create(&module); }
