// Run-time defaults of the sanitizers for the project's own binaries (MOE_ENABLE_SANITIZERS).
// Open MPI keeps allocations made by MPI_Init until exit on purpose, and some come from
// components it has dlclose'd (so no suppression can name them): leak checking is off. ASan's
// memory checks stay on, and UBSan stops at the first finding so a test fails on it.
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }
extern "C" const char* __ubsan_default_options() { return "print_stacktrace=1:halt_on_error=1"; }
