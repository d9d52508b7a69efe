// A C++ extension that builds in a second or two: the native build's tests compile it instead of
// the CPU expert kernel.
#include <Python.h>

#include "answer.h"

#define MOELAB_STR2(x) #x
#define MOELAB_STR(x) MOELAB_STR2(x)
#define MOELAB_INIT2(name) PyInit_##name
#define MOELAB_INIT(name) MOELAB_INIT2(name)

static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(kAnswer); }

static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};

static PyModuleDef module_def = {PyModuleDef_HEAD_INIT, MOELAB_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};

PyMODINIT_FUNC MOELAB_INIT(TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
