# Shared by bench/train_perf.sh and bench/train_layouts.sh (sourced): environment for mpirun as
# root with one BLAS thread per rank, and parse_summary, which reads train_moe's summary lines.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OPENBLAS_NUM_THREADS=1
export OMPI_MCA_mpi_yield_when_idle=1

# parse_summary LOG: sets loss, tps (tokens/s/device), split ("GEMMs / comm / rest"), step and
# yard (ms) and ratio from a train_moe log.
parse_summary() {
  loss=$(sed -n 's/^summary: final loss \([0-9.]*\) .*/\1/p' <<<"$1")
  tps=$(sed -n 's/^summary: tokens\/s\/device \([0-9.]*\);.*/\1/p' <<<"$1")
  split=$(sed -n 's/^summary: .*step time: expert GEMMs \([^,]*\), communication \([^,]*\), rest \(.*\)$/\1 \/ \2 \/ \3/p' <<<"$1")
  read -r step yard ratio < <(sed -n 's/^summary: step \([0-9.]*\) ms; .* alone \([0-9.]*\) ms; ratio \([0-9.]*\)$/\1 \2 \3/p' <<<"$1")
}
