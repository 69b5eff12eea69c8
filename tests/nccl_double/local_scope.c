/*
 * The driver loaded the way PyTorch loads NCCL: its library is dlopen()ed with RTLD_LOCAL, and
 * libnccl.so.2 comes with it as a dependency, into that local scope. A preloaded interposer still
 * receives the driver's NCCL calls (the global scope is searched first) but cannot reach the real
 * library with dlsym(RTLD_NEXT). DRIVER_LIB: the driver built as a shared library whose main() is
 * named megatrace_driver_main.
 */
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv)
{
    void *lib = dlopen(DRIVER_LIB, RTLD_NOW | RTLD_LOCAL);
    int (*driver_main)(int, char **);
    if (!lib) {
        fprintf(stderr, "local_scope: %s\n", dlerror());
        return 2;
    }
    driver_main = (int (*)(int, char **))dlsym(lib, "megatrace_driver_main");
    if (!driver_main) {
        fprintf(stderr, "local_scope: %s\n", dlerror());
        return 2;
    }
    return driver_main(argc, argv);
}
