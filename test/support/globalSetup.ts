// One PostgreSQL for the whole run: DATABASE_URL when it is set, otherwise a throw-away embedded
// cluster. Each test file then creates its own database on it (test/support/db.ts).
import { mkdtemp } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import path from 'node:path';
import type { TestProject } from 'vitest/node';
import { startEmbeddedPostgres } from '../../src/db/embedded.ts';
import { createLogger } from '../../src/telemetry/log.ts';

declare module 'vitest' {
  export interface ProvidedContext {
    adminUrl: string;
  }
}

export default async function setup(project: TestProject) {
  if (process.env.DATABASE_URL) {
    project.provide('adminUrl', process.env.DATABASE_URL);
    return;
  }
  const dataDir = await mkdtemp(path.join(tmpdir(), 'outboxd-test-'));
  const cluster = await startEmbeddedPostgres({ dataDir, persistent: false, log: createLogger('warn') });
  project.provide('adminUrl', cluster.url);
  return () => cluster.stop();
}
