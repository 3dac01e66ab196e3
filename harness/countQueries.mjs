// Preloaded by npm run bench into a worker process (NODE_OPTIONS=--import …): counts the statements its
// pg clients send — pg-boss's and outboxd's alike, each one round trip to PostgreSQL — and writes the
// count to BENCH_QUERY_COUNT_FILE when the process exits. JavaScript, not TypeScript: a preload must not
// load the type stripper into a process that would otherwise run without it (the image runs dist/).
import { writeFileSync } from 'node:fs';
import pg from 'pg';

const file = process.env.BENCH_QUERY_COUNT_FILE;
if (file) {
  let sent = 0;
  const query = pg.Client.prototype.query;
  pg.Client.prototype.query = function (...args) {
    sent++;
    return query.apply(this, args);
  };
  process.on('exit', () => writeFileSync(file, String(sent)));
}
