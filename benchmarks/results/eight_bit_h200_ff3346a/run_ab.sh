set -u
OUT=${OUT:-ab_out}; mkdir -p $OUT
for tag in head lean nested head2; do
  tree=${tag%2}
  PYTHONPATH=ab/$tree/src python3 -u ab/ab_probe.py $tag > $OUT/ab_$tag.log 2>&1 || tail -5 $OUT/ab_$tag.log
done
PYTHONPATH=ab/nested/src LIK_AB_PPS=2 python3 -u ab/ab_probe.py nested_pps2 > $OUT/ab_nested_pps2.log 2>&1 || tail -5 $OUT/ab_nested_pps2.log
grep -h "ms" $OUT/ab_*.log | sort -k2,2 -k3,3 -s
