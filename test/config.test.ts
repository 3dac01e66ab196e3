// The environment as operators write it: env files leave optional values empty, and listeners are
// placed by port and address.
import { describe, expect, it } from 'vitest';
import { envSchema, loadConfig } from '../src/config.ts';

describe('loadConfig', () => {
  it('an empty or blank value of any variable means unset', () => {
    const defaults = loadConfig({});
    for (const key of Object.keys(envSchema.shape)) {
      expect(loadConfig({ [key]: '' }), key).toEqual(defaults);
      expect(loadConfig({ [key]: '  ' }), key).toEqual(defaults);
    }
  });
});
