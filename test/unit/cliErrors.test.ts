// What the CLI prints for a missing table (src/cli/exit.ts): the migrations not run there, unless the
// command that failed is the migration itself, whose error is shown as it is.
import { expect, it } from 'vitest';
import { errorMessage } from '../../src/cli/exit.ts';

const missing = Object.assign(new Error('relation "payments.payment_operations" does not exist'), { code: '42P01' });

it('a missing relation names the schema, outboxd migrate, DATABASE_URL and OUTBOXD_SCHEMA', () => {
  expect(errorMessage(missing, { command: 'list', schema: 'payments' })).toBe(
    'the database is not migrated in the schema payments (relation "payments.payment_operations" does not exist): run `outboxd migrate`, or check DATABASE_URL and OUTBOXD_SCHEMA',
  );
});

it('outboxd migrate failing on a missing relation is not told to run itself', () => {
  expect(errorMessage(missing, { command: 'migrate', schema: 'payments' })).toBe('relation "payments.payment_operations" does not exist');
});
