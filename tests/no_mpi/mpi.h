// Ahead of every include directory of the targets built on moe's one-process MPI stand-in
// (moe_serial, MOE_ENABLE_MPI=0): reaching it means some header still includes <mpi.h>
// directly instead of <moe/comm/mpi.hpp>.
#error "<mpi.h> included in a build without MPI (MOE_ENABLE_MPI=0): include <moe/comm/mpi.hpp>"
